"""The fp8 mma.sync Gluon decode under the mma.sync proxy, routed for sm_120 and for sm_86, against the ``tl`` tile
(``sparse_mla_decode_triton`` with ``NSA_BACKEND_GLUON=1`` / ``0``), same process, CUDA graphs, L2 evicted before each
call, topk 2048, both scale formats. Under sm_86 the Gluon kernel decodes e4m3 with integer operations, as on an
sm_80 / 86 GPU. ``HEAD_KERNEL`` (optional): the path of an earlier ``sm89_gluon.py``, timed beside under sm_120.

    DISABLE_MMA_V3=1 PYTHONPATH=. OUT=<dir> [HEAD_KERNEL=<file>] python sweep.py   # <dir>/sweep.jsonl
"""

import importlib.util
import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton
from nsa_backend.routing.config import reset_config

SM120_SHARED_PER_BLOCK = 101376
TOPK = 2048


def with_env(values: dict, fn):
    os.environ.update(values)
    reset_config()
    try:
        return fn()
    finally:
        for k in values:
            os.environ.pop(k)
        reset_config()


def head_kernel():
    path = os.environ.get("HEAD_KERNEL")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("head_sm89_gluon", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sparse_mla_decode_mma_v2


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")  # sm_86 has the same 100 KiB per SM
    dev = torch.device("cuda")
    log = open(os.path.join(os.environ.get("OUT", "."), "sweep.jsonl"), "a")

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        log.write(json.dumps(d) + "\n")

    copy = copy_gbps(dev, 2 * 2**30)
    bf16 = triton_matmul.best_tflops(8192, torch.bfloat16, dev, SM120_SHARED_PER_BLOCK)[0]
    emit({"copy_gbps": copy, "bf16_tflops": bf16, "gpu": torch.cuda.get_device_name()})
    head = head_kernel()
    # (the shapes in order of interest, each routed for both archs, so that a cut run keeps the first)
    for B, s_q in ((128, 1), (32, 1), (128, 2)):
        for h_q in (128, 64, 32, 16):
            a = decode_inputs(B, s_q, h_q, TOPK, dev)
            for arch in ("sm120", "sm86"):
                flops = 2.0 * B * s_q * h_q * TOPK * (576 + 512)
                nbytes = B * s_q * TOPK * 656
                row: dict = {"arch": arch, "B": B, "s_q": s_q, "h_q": h_q}
                for fmt in ("pow2", None):
                    def call(a=a, fmt=fmt):
                        return sparse_mla_decode_triton(a["q"], a["kv_cache"], a["indices"], a["sm_scale"],
                                                        kv_scale_format=fmt)

                    env = {"NSA_BACKEND_FORCE_ARCH": arch}
                    ms_tl = with_env({**env, "NSA_BACKEND_GLUON": "0"}, lambda: bench_ms(call, graph=True))
                    ms_g = with_env({**env, "NSA_BACKEND_GLUON": "1"}, lambda: bench_ms(call, graph=True))
                    out_tl = with_env({**env, "NSA_BACKEND_GLUON": "0"}, call)[0]
                    out_g = with_env({**env, "NSA_BACKEND_GLUON": "1"}, call)[0]
                    r = {"tl_ms": round(ms_tl, 4), "mma_v2_ms": round(ms_g, 4), "speedup": round(ms_tl / ms_g, 3),
                         "tl_vs_bf16": round(flops / ms_tl / 1e9 / bf16, 3),
                         "mma_v2_vs_bf16": round(flops / ms_g / 1e9 / bf16, 3),
                         "tl_vs_copy": round(nbytes / ms_tl / 1e6 / copy, 3),
                         "mma_v2_vs_copy": round(nbytes / ms_g / 1e6 / copy, 3),
                         "max_abs_diff": (out_tl.float() - out_g.float()).abs().max().item()}
                    if head is not None and arch == "sm120":
                        def head_call(a=a, fmt=fmt):
                            return head(a["q"], a["kv_cache"], a["indices"], a["sm_scale"], kv_scale_format=fmt)

                        ms_h = with_env(env, lambda: bench_ms(head_call, graph=True))
                        r["head_ms"] = round(ms_h, 4)
                        r["vs_head"] = round(ms_h / ms_g, 3)
                    row[f"scales={fmt or 'arbitrary'}"] = r
                emit(row)
            del a
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
