"""DeepSeek-V4 sparse decode: our Triton tile against FlashMLA's V4 kernel on the same inputs and GPU.

CUDA-graph replays of ``sparse_mla_decode(kv_format="fp8_ds_mla_v4")`` with ``impl="triton"`` and
``impl="flash_mla"`` (FlashMLA installed) at B 128, h_q 64 / 128, context 8K / 32K, top-k 512 compressed keys
plus the 128-token window (the inputs of the benchmark's ``peers`` family), with the largest difference
of the two outputs::

    python bench/v4_side_by_side.py
"""

from __future__ import annotations

import torch

from nsa_backend.bench import peers
from nsa_backend.bench.timing import bench_ms


def main() -> None:
    dev = torch.device("cuda")
    for h_q in (64, 128):
        for context in (8192, 32768):
            a = peers.v4_decode_inputs(128, h_q, context, peers.V4_WINDOW, peers.V4_TOPK, dev)
            ours = bench_ms(lambda a=a: peers._ours_v4(a, "triton"), 10, 50, graph=True)
            native = bench_ms(lambda a=a: peers._ours_v4(a, "flash_mla"), 10, 50, graph=True)
            diff = (peers._ours_v4(a, "triton")[0].float() - peers._ours_v4(a, "flash_mla")[0].float()).abs().max()
            print(f"v4 B=128 h_q={h_q} context={context} triton {ours:.4f} ms flash_mla {native:.4f} ms "
                  f"ratio {native / ours:.3f} maxdiff {diff.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
