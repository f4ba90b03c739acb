"""The fp8 decode under the sm120 proxy: ``sparse_mla_decode_triton`` with the mma.sync Gluon kernel
(``NSA_BACKEND_GLUON=1``) and with the ``tl`` tile (``NSA_BACKEND_GLUON=0``), same process, CUDA graphs, L2
evicted before each call; ``hot_keys``: every top-k list cycles over one page (no gather from memory).

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=. OUT=<dir> python sweep.py   # <dir>/sweep.jsonl
"""

import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs, hot_key_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

SM120_SHARED_PER_BLOCK = 101376


def timed(fn, gluon: str) -> float:
    os.environ["NSA_BACKEND_GLUON"] = gluon
    try:
        return bench_ms(fn, graph=True)
    finally:
        os.environ.pop("NSA_BACKEND_GLUON")


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
    for B in (128, 32):
        for s_q in (1, 2):
            for h_q in (128, 64, 32, 16):
                a = decode_inputs(B, s_q, h_q, 2048, dev)
                flops = 2.0 * B * s_q * h_q * 2048 * (576 + 512)
                nbytes = B * s_q * 2048 * 656
                row: dict = {"B": B, "s_q": s_q, "h_q": h_q}
                for fmt in ("pow2", None):
                    def call(a=a, fmt=fmt):
                        return sparse_mla_decode_triton(a["q"], a["kv_cache"], a["indices"], a["sm_scale"],
                                                        kv_scale_format=fmt)

                    ms_tl, ms_g = timed(call, "0"), timed(call, "1")
                    row[f"scales={fmt or 'arbitrary'}"] = {
                        "tl_ms": round(ms_tl, 4), "mma_v2_ms": round(ms_g, 4), "speedup": round(ms_tl / ms_g, 3),
                        "tl_vs_bf16": round(flops / ms_tl / 1e9 / bf16, 3),
                        "mma_v2_vs_bf16": round(flops / ms_g / 1e9 / bf16, 3),
                        "tl_vs_copy": round(nbytes / ms_tl / 1e6 / copy, 3),
                        "mma_v2_vs_copy": round(nbytes / ms_g / 1e6 / copy, 3)}
                if (B, s_q) == (128, 1) and h_q in (128, 64):
                    h = hot_key_inputs(a, "fp8_ds_mla")

                    def hot(h=h):
                        return sparse_mla_decode_triton(h["q"], h["kv_cache"], h["indices"], h["sm_scale"],
                                                        kv_scale_format="pow2")

                    ms_tl, ms_g = timed(hot, "0"), timed(hot, "1")
                    row["hot_keys"] = {"tl_vs_bf16": round(flops / ms_tl / 1e9 / bf16, 3),
                                       "mma_v2_vs_bf16": round(flops / ms_g / 1e9 / bf16, 3)}
                emit(row)
                del a
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
