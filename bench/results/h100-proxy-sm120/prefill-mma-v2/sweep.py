"""The bf16 sparse MLA prefill under the sm120 proxy: ``flash_mla_sparse_fwd_triton`` with the mma.sync Gluon
kernel (``NSA_BACKEND_GLUON=1``) and with the ``tl`` tile (``NSA_BACKEND_GLUON=0``), same process, CUDA graphs, L2
evicted before each call, s_q 4096, s_kv 32768, topk 2048; ``hot_keys``: every top-k list cycles over 64 rows (no
gather from memory). ``max_abs_diff``: the largest ``out`` difference between the two kernels.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=. OUT=<dir> python sweep.py   # <dir>/sweep.jsonl
"""

import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.sparse_mla import prefill_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

SM120_SHARED_PER_BLOCK = 101376
S_Q, S_KV, TOPK = 4096, 32768, 2048
HOT_ROWS = 64


def with_gluon(gluon: str, fn):
    os.environ["NSA_BACKEND_GLUON"] = gluon
    try:
        return fn()
    finally:
        os.environ.pop("NSA_BACKEND_GLUON")


def prefill(a: dict):
    return flash_mla_sparse_fwd_triton(a["q"], a["kv"], a["indices"], a["sm_scale"])


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    log = open(os.path.join(os.environ.get("OUT", "."), "sweep.jsonl"), "a")

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        log.write(json.dumps(d) + "\n")

    bf16 = triton_matmul.best_tflops(8192, torch.bfloat16, dev, SM120_SHARED_PER_BLOCK)[0]
    emit({"bf16_tflops": bf16, "gpu": torch.cuda.get_device_name()})
    for h_q in (128, 64, 32, 16):
        a = prefill_inputs(S_Q, S_KV, h_q, TOPK, dev)
        hot = dict(a, indices=(torch.arange(TOPK, device=dev, dtype=torch.int32) % HOT_ROWS).expand_as(a["indices"])
                   .contiguous())
        flops = 2.0 * S_Q * h_q * TOPK * (576 + 512)
        row: dict = {"h_q": h_q}
        for name, args in (("gathered", a), ("hot_keys", hot)):
            def call(args=args):
                return prefill(args)

            ms_tl = with_gluon("0", lambda call=call: bench_ms(call, graph=True))
            ms_g = with_gluon("1", lambda call=call: bench_ms(call, graph=True))
            row[name] = {"tl_ms": round(ms_tl, 3), "mma_v2_ms": round(ms_g, 3), "speedup": round(ms_tl / ms_g, 3),
                         "tl_vs_bf16": round(flops / ms_tl / 1e9 / bf16, 3),
                         "mma_v2_vs_bf16": round(flops / ms_g / 1e9 / bf16, 3)}
        out_tl = with_gluon("0", lambda a=a: prefill(a))
        out_g = with_gluon("1", lambda a=a: prefill(a))
        row["max_abs_diff"] = (out_tl[0].float() - out_g[0].float()).abs().max().item()
        row["lse_max_abs_diff"] = (out_tl[2] - out_g[2]).abs().max().item()
        emit(row)
        del a, hot, out_tl, out_g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
