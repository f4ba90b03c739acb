"""The bf16 mma.sync prefill with ``P V`` taken in two 16-key halves (``PV_SPLIT``: the path of a ``sm80_gluon.py``
whose ``mma_v2_attend_tile`` does so) against the shipped kernel: its 300-case fuzz against the reference, then both
timed in the same process under the proxy (s_q 4096, s_kv 32768, topk 2048, CUDA graphs, L2 evicted).

    DISABLE_MMA_V3=1 PYTHONPATH=. OUT=<dir> PV_SPLIT=<file> python pv_split.py   # <dir>/pv_split.jsonl
"""

import importlib.util
import json
import os

import torch

from nsa_backend.bench import proxy, triton_matmul
from nsa_backend.bench.sparse_mla import prefill_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as shipped
from tests.ops import test_sparse_mla_prefill_mma_v2 as T
from tests.ops.test_sparse_mla import prefill_case, run_prefill_case

SM120_SHARED_PER_BLOCK = 101376


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    spec = importlib.util.spec_from_file_location("pv_split_sm80_gluon", os.environ["PV_SPLIT"])
    new = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(new)
    log = open(os.path.join(os.environ.get("OUT", "."), "pv_split.jsonl"), "a")

    def emit(d: dict) -> None:
        print(json.dumps(d), flush=True)
        log.write(json.dumps(d) + "\n")
        log.flush()

    bf16 = triton_matmul.best_tflops(8192, torch.bfloat16, dev, SM120_SHARED_PER_BLOCK)[0]
    emit({"bf16_tflops": bf16, "gpu": torch.cuda.get_device_name()})
    for h_q in (128, 64, 32):
        a = prefill_inputs(4096, 32768, h_q, 2048, dev)
        flops = 2.0 * 4096 * h_q * 2048 * (576 + 512)
        for rnd in range(2):
            ms_old = bench_ms(lambda a=a: shipped.flash_mla_sparse_fwd_mma_v2(**a), graph=True)
            ms_new = bench_ms(lambda a=a: new.flash_mla_sparse_fwd_mma_v2(**a), graph=True)
            diff = (shipped.flash_mla_sparse_fwd_mma_v2(**a)[0].float()
                    - new.flash_mla_sparse_fwd_mma_v2(**a)[0].float()).abs().max().item()
            emit({"h_q": h_q, "round": rnd, "shipped_ms": round(ms_old, 4), "pv_split_ms": round(ms_new, 4),
                  "speedup": round(ms_old / ms_new, 3), "shipped_vs_bf16": round(flops / ms_old / 1e9 / bf16, 3),
                  "pv_split_vs_bf16": round(flops / ms_new / 1e9 / bf16, 3), "max_abs_diff": diff})
        del a
        torch.cuda.empty_cache()
    errs, failed = [], []
    for c, kw in T._fuzz_cases(T.FUZZ_CASES, seed=29):
        try:
            errs.append(run_prefill_case(prefill_case(**c), f"{c} {kw}", prefill=new.flash_mla_sparse_fwd_mma_v2, **kw))
        except AssertionError as e:
            failed.append(f"{c} {kw}: {str(e)[:300]}")
    emit({"fuzz_cases": len(errs) + len(failed), "failed": failed[:5], "n_failed": len(failed),
          "max_abs_err": max(errs) if errs else None})


if __name__ == "__main__":
    main()
