"""The fp8 mma.sync decode with another conversion layout (``CAND``: a folder holding a
``sparse_mla_prefill/sm80_gluon.py`` and a ``sparse_mla_decode/sm89_gluon.py``) against the tree's, same process,
under the proxy (CUDA graphs, L2 evicted before each call): B 128, s_q 1, topk 2048, both scale formats, routed for
sm_120 and for sm_86. Each pair is timed twice, alternating. ``H_DECODE``: the head counts (default 128,64,32,16).

    DISABLE_MMA_V3=1 PYTHONPATH=. OUT=<dir> CAND=<dir> python ab.py   # <dir>/ab.jsonl
"""

import importlib.util
import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as fp8_decode
from nsa_backend.routing.config import reset_config

SM120_SHARED_PER_BLOCK = 101376
TOPK = 2048


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def heads(var: str, default: str) -> list[int]:
    return [int(h) for h in os.environ.get(var, default).split(",")]


def forced(arch: str, fn):
    os.environ["NSA_BACKEND_FORCE_ARCH"] = arch
    reset_config()
    try:
        return fn()
    finally:
        os.environ.pop("NSA_BACKEND_FORCE_ARCH")
        reset_config()


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    cand_dir = os.environ["CAND"]
    cand_prefill = load("cand_prefill", os.path.join(cand_dir, "sparse_mla_prefill", "sm80_gluon.py"))
    cand_fp8 = load("cand_fp8_decode", os.path.join(cand_dir, "sparse_mla_decode", "sm89_gluon.py"))
    # the candidate's tile body, bound before its first compile
    for name in ("mma_v2_attend_tile", "mma_v2_load_q", "mma_v2_scores_smem", "mma_v2_store"):
        setattr(cand_fp8, name, getattr(cand_prefill, name))
    log = open(os.path.join(os.environ.get("OUT", "."), "ab.jsonl"), "a")

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        log.write(json.dumps(d) + "\n")
        log.flush()

    copy = copy_gbps(dev, 2 * 2**30)
    bf16 = triton_matmul.best_tflops(8192, torch.bfloat16, dev, SM120_SHARED_PER_BLOCK)[0]
    emit({"cand": os.path.basename(os.path.normpath(cand_dir)), "copy_gbps": copy, "bf16_tflops": bf16,
          "gpu": torch.cuda.get_device_name()})

    def pair(row: dict, tree_call, cand_call, flops: float, nbytes: float | None = None) -> None:
        for rnd in range(2):
            ms_t = bench_ms(tree_call, graph=True)
            ms_c = bench_ms(cand_call, graph=True)
            r = {**row, "round": rnd, "tree_ms": round(ms_t, 4), "cand_ms": round(ms_c, 4),
                 "speedup": round(ms_t / ms_c, 3), "tree_vs_bf16": round(flops / ms_t / 1e9 / bf16, 3),
                 "cand_vs_bf16": round(flops / ms_c / 1e9 / bf16, 3)}
            if nbytes is not None:
                r["tree_vs_copy"] = round(nbytes / ms_t / 1e6 / copy, 3)
                r["cand_vs_copy"] = round(nbytes / ms_c / 1e6 / copy, 3)
            if rnd == 0:
                r["max_abs_diff"] = (tree_call()[0].float() - cand_call()[0].float()).abs().max().item()
            emit(r)

    def decode_pairs(h_q: int) -> None:
        a = decode_inputs(128, 1, h_q, TOPK, dev)
        flops = 2.0 * 128 * h_q * TOPK * (576 + 512)
        fp8_args = (a["q"], a["kv_cache"], a["indices"], a["sm_scale"])
        for arch in ("sm120", "sm86"):
            for fmt in ("pow2", None):
                row = {"op": "decode_fp8", "arch": arch, "scales": fmt or "any", "h_q": h_q}
                forced(arch, lambda row=row, fmt=fmt: pair(
                    row, lambda: fp8_decode.sparse_mla_decode_mma_v2(*fp8_args, kv_scale_format=fmt),
                    lambda: cand_fp8.sparse_mla_decode_mma_v2(*fp8_args, kv_scale_format=fmt), flops,
                    128 * TOPK * 656))

    for h_q in heads("H_DECODE", "128,64,32,16"):
        decode_pairs(h_q)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
