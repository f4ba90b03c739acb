"""The bf16 mma.sync Gluon kernel under the sm120 proxy, against the ``tl`` tile (``NSA_BACKEND_GLUON=1`` / ``0``),
same process, CUDA graphs, L2 evicted before each call: the prefill (``flash_mla_sparse_fwd_triton``, s_q 4096,
s_kv 32768, topk 2048) and the decode over a bf16 paged cache (``sparse_mla_decode_triton``, topk 2048, B 128 with
s_q 1 / 2, B 32 with s_q 1). ``max_abs_diff``: the largest ``out`` difference between the two kernels.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=. OUT=<dir> python sweep.py   # <dir>/sweep.jsonl
"""

import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs, prefill_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton
from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

SM120_SHARED_PER_BLOCK = 101376
TOPK = 2048


def with_gluon(gluon: str, fn):
    os.environ["NSA_BACKEND_GLUON"] = gluon
    try:
        return fn()
    finally:
        os.environ.pop("NSA_BACKEND_GLUON")


def compare(call, flops: float, bf16: float, nbytes: float, copy: float) -> dict:
    ms_tl = with_gluon("0", lambda: bench_ms(call, graph=True))
    ms_g = with_gluon("1", lambda: bench_ms(call, graph=True))
    out_tl, out_g = with_gluon("0", call)[0], with_gluon("1", call)[0]
    return {"tl_ms": round(ms_tl, 4), "mma_v2_ms": round(ms_g, 4), "speedup": round(ms_tl / ms_g, 3),
            "tl_vs_bf16": round(flops / ms_tl / 1e9 / bf16, 3), "mma_v2_vs_bf16": round(flops / ms_g / 1e9 / bf16, 3),
            "tl_vs_copy": round(nbytes / ms_tl / 1e6 / copy, 3), "mma_v2_vs_copy": round(nbytes / ms_g / 1e6 / copy, 3),
            "max_abs_diff": (out_tl.float() - out_g.float()).abs().max().item()}


def bf16_cache(a: dict) -> torch.Tensor:
    """A bf16 paged cache ``[num_blocks, page, 1, 576]`` over the slots of ``a``'s fp8 cache."""
    num_blocks, page = a["kv_cache"].shape[:2]
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(num_blocks, page, 1, 576, generator=g).to(device=a["q"].device, dtype=torch.bfloat16)


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    log = open(os.path.join(os.environ.get("OUT", "."), "sweep.jsonl"), "a")

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        log.write(json.dumps(d) + "\n")

    copy = copy_gbps(dev, 2 * 2**30)
    bf16 = triton_matmul.best_tflops(8192, torch.bfloat16, dev, SM120_SHARED_PER_BLOCK)[0]
    emit({"copy_gbps": copy, "bf16_tflops": bf16, "gpu": torch.cuda.get_device_name()})
    # (the shapes of the targets first)
    for op, shape in (("prefill", 128), ("prefill", 64), ("decode", (128, 1)), ("prefill", 32), ("prefill", 16),
                      ("decode", (128, 2)), ("decode", (32, 1))):
        if op == "prefill":
            emit({"op": "prefill", "h_q": shape, **prefill_row(shape, dev, bf16, copy)})
            continue
        B, s_q = shape
        for h_q in (128, 64, 32, 16):
            emit({"op": "decode_bf16", "B": B, "s_q": s_q, "h_q": h_q, **decode_row(B, s_q, h_q, dev, bf16, copy)})


def prefill_row(h_q: int, dev: torch.device, bf16: float, copy: float) -> dict:
    a = prefill_inputs(4096, 32768, h_q, TOPK, dev)
    flops = 2.0 * 4096 * h_q * TOPK * (576 + 512)
    row = compare(lambda: flash_mla_sparse_fwd_triton(a["q"], a["kv"], a["indices"], a["sm_scale"]),
                  flops, bf16, 4096 * TOPK * 1152, copy)
    torch.cuda.empty_cache()
    return row


def decode_row(B: int, s_q: int, h_q: int, dev: torch.device, bf16: float, copy: float) -> dict:
    a = decode_inputs(B, s_q, h_q, TOPK, dev)
    cache = bf16_cache(a)
    flops = 2.0 * B * s_q * h_q * TOPK * (576 + 512)
    row = compare(lambda: sparse_mla_decode_triton(a["q"], cache, a["indices"], a["sm_scale"], kv_format="bf16"),
                  flops, bf16, B * s_q * TOPK * 1152, copy)
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
