"""The fp8 decode's lazy rescale emulated in torch on CPU, tile by tile (32 keys, the reference moved past 8 in base 2,
P rounded to bf16), on the data of ``test_decode_mma_v2_rescale_threshold_gpu`` and checked as that test checks the
kernel: with the rescale, and with ``O``'s rescale left out, which the checks must reject.

    PYTHONPATH=. python bench/results/h100-proxy-sm120/lazy-rescale/emulate_threshold.py   # emulate_threshold.txt
"""

import torch

from nsa_backend import reference as ref
from tests.ops.test_sparse_mla import _check_out, _check_stat, _fp32_reference_decode
from tests.ops.test_sparse_mla_decode_mma_v2 import threshold_case

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def emulate(a: dict, rescale: bool = True, tau: float = 8.0, block_n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and natural-log ``lse`` of the lazy online softmax over each row's list, in its order."""
    kv = ref.unpack_fp8_ds_mla(a["kv_cache"].view(-1, 656)).float()  # the reference's dequantised keys
    q = a["q"].float()
    rows, heads = q.shape[0], q.shape[2]
    out = torch.zeros(rows, 1, heads, 512)
    lse = torch.zeros(rows, 1, heads)
    for b in range(rows):
        idx = a["indices"][b, 0].long()
        score = (q[b, 0] @ kv[idx].T) * a["sm_scale"] * LOG2E  # [heads, keys], base 2
        ref_max = torch.full((heads,), float("-inf"))
        total = torch.zeros(heads)
        acc = torch.zeros(heads, 512)
        for t0 in range(0, idx.numel(), block_n):
            s_tile = score[:, t0:t0 + block_n]
            tile_max = s_tile.max(1).values
            new_max = torch.where(tile_max > ref_max + tau, tile_max, ref_max)
            use = torch.where(new_max == float("-inf"), 0.0, new_max)
            p = torch.exp2(s_tile - use[:, None])
            alpha = torch.exp2(ref_max - use)
            total = total * alpha + p.sum(1)
            acc = (acc * alpha[:, None] if rescale else acc) + p.bfloat16().float() @ kv[idx[t0:t0 + block_n], :512]
            ref_max = new_max
        out[b, 0] = acc / total[:, None]
        lse[b, 0] = (ref_max + torch.log2(total)) * LN2
    return out, lse


def main() -> None:
    for h_q in (32, 128):
        for scale_format in ("arbitrary", "pow2"):
            a = threshold_case(h_q, scale_format, 32, device="cpu")
            r_out, r_lse, r_abs = _fp32_reference_decode(a)
            for rescale in (True, False):
                name = f"h_q {h_q}, {scale_format} scales, {'with' if rescale else 'without'} O's rescale"
                out, lse = emulate(a, rescale)
                try:
                    _check_out("out", out.bfloat16().view(r_out.shape), r_out, name, r_abs)
                    _check_stat("lse", lse.view(r_lse.shape), r_lse, name)
                    print(f"{name}: passes the test's checks")
                except AssertionError as e:
                    print(f"{name}: rejected ({str(e).splitlines()[0]})")


if __name__ == "__main__":
    main()
