"""The paged mma.sync Gluon kernel against the tl entry under the sm120 proxy.

One and two query rows, fp16 and e4m3 products, chunks planned for 2 or 4 programs per SM (B 128, CUDA graph,
share of the copy rate); first the error against the reference on a small case of each. Ran on an NVIDIA H100
80GB HBM3 (torch 2.11, triton 3.6) with the kernels of 59650fe and 261f12b: sweep-<commit>.jsonl.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=$PWD \
        python bench/results/h100-proxy-sm120/paged-mma-v2-rows/sweep.py

On sm_90 an e4m3 product is an fp16 MMA behind conversions of both operands that ptxas emits.
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
SMS = torch.cuda.get_device_properties(0).multi_processor_count


for next_n, H in ((1, 64), (2, 32), (2, 20), (2, 64), (1, 32), (2, 16)):
    q, cache, w, ctx, table = paged_inputs(4, 4096, next_n, H, 128)
    ctx = torch.tensor([4096, 1000, 77, 3000], dtype=torch.int32, device=dev)
    ref = reference.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, 4096)
    for e4 in (False, True):
        out = mma_v2(q, cache, w, ctx, table, 4096, chunk=1024, e4m3=e4)
        fin = torch.isfinite(ref)
        err = ((out - ref).abs()[fin].max() / ref[fin].abs().max()).item()
        same_inf = bool((torch.isinf(out) == torch.isinf(ref)).all())
        print(json.dumps({"check": [next_n, H, e4], "err": err, "same_inf": same_inf}), flush=True)

def timed_row(next_n: int, H: int, L: int, copy: float) -> dict:
    B, D = 128, 128
    q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D)
    nbytes = B * L * (D + 4)
    cfg = cfgs.paged_config(H, next_n, D, 120)
    row = {"next_n": next_n, "H": H, "L": L}
    ms = bench_ms(lambda: fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, L, config=cfg), 10, 40,
                  graph=True)
    row["tl"] = round(nbytes / ms / 1e6 / copy, 3)
    for e4 in (False, True):
        for res in (2, 4):
            ch = cfgs.paged_chunk(B, L, SMS, 64, res)
            ms = bench_ms(lambda e4=e4, ch=ch: mma_v2(q, cache, w, ctx, table, L, chunk=ch, e4m3=e4), 10, 40,
                          graph=True)
            row[f"{'e4' if e4 else 'f16'}r{res}"] = round(nbytes / ms / 1e6 / copy, 3)
    return row


copy = copy_gbps(dev, 2 * 2**30)
print("copy", round(copy, 1), flush=True)
for next_n, H in ((2, 32), (1, 64), (2, 64), (1, 32), (2, 16)):
    for L in (8192, 32768, 65536):
        print(json.dumps(timed_row(next_n, H, L, copy)), flush=True)
        torch.cuda.empty_cache()
