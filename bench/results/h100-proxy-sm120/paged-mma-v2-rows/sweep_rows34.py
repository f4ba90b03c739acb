"""next_n 3 and 4 under the sm120 proxy: the mma.sync Gluon kernel (two rows per program) against the tl entry.

A check of the kernel against the reference on a small case of three shapes, then B 128, CUDA graph, share of the
copy rate. Ran twice on an NVIDIA H100 80GB HBM3 (torch 2.11, triton 3.6) with the kernel of 261f12b:
sweep_rows34-261f12b-first.jsonl and sweep_rows34-261f12b.jsonl.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=$PWD \
        python bench/results/h100-proxy-sm120/paged-mma-v2-rows/sweep_rows34.py
"""
import json

import torch

from nsa_backend import reference
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import indexer as cfgs
from nsa_backend.kernels.indexer import fp8_paged_mqa_logits_triton
from nsa_backend.kernels.indexer.sm89_gluon_paged import fp8_paged_mqa_logits_mma_v2 as mma_v2

print("carveout", proxy.limit_shared_memory_per_sm("sm120"), flush=True)
dev = torch.device("cuda")
for next_n, H in ((3, 64), (4, 32), (3, 17)):
    q, cache, w, ctx, table = paged_inputs(4, 4096, next_n, H, 128)
    ctx = torch.tensor([4096, 1000, 77, 3000], dtype=torch.int32, device=dev)
    ref = reference.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, 4096)
    out = mma_v2(q, cache, w, ctx, table, 4096, chunk=1024)
    fin = torch.isfinite(ref)
    err = ((out - ref).abs()[fin].max() / ref[fin].abs().max()).item()
    same_inf = bool((torch.isinf(out) == torch.isinf(ref)).all())
    print(json.dumps({"check": [next_n, H], "err": err, "same_inf": same_inf}), flush=True)


def timed_row(next_n: int, H: int, L: int, copy: float) -> dict:
    B, D = 128, 128
    q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D)
    nbytes = B * L * (D + 4)
    cfg = cfgs.paged_config(H, next_n, D, 120)
    row = {"next_n": next_n, "H": H, "L": L}
    ms = bench_ms(lambda: fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, L, config=cfg), 10, 40,
                  graph=True)
    row["tl"] = round(nbytes / ms / 1e6 / copy, 3)
    ms = bench_ms(lambda: mma_v2(q, cache, w, ctx, table, L), 10, 40, graph=True)
    row["mma_v2"] = round(nbytes / ms / 1e6 / copy, 3)
    return row


copy = copy_gbps(dev, 2 * 2**30)
print("copy", round(copy, 1), flush=True)
for next_n, H in ((4, 64), (4, 32), (3, 64), (3, 32), (4, 16)):
    for L in (8192, 32768, 65536):
        print(json.dumps(timed_row(next_n, H, L, copy)), flush=True)
        torch.cuda.empty_cache()
