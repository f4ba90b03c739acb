"""Host time of the public decode-path ops' validation and routing, without the kernel (CPU only).

Each public op is called with CPU tensors of the eager family's decode shapes while the function it
dispatches to is replaced by a no-op, so what is timed is the op's own Python work per call: argument
checks, the routing decision (cached) and the dispatch. Median of 7 rounds of 3000 calls.

    python bench/host_validation.py > bench/results/cpu-host-validation/<label>.md
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import nsa_backend as nb
from nsa_backend import indexer, sparse_mla, topk

FP8 = torch.float8_e4m3fn
B, CONTEXT, HEADS, DIM, TOPK, PAGE = 32, 8192, 64, 128, 2048, 64


def _time_us(fn: Callable[[], object], calls: int = 3000, rounds: int = 7) -> float:
    fn()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_round)


def main() -> None:
    pages = B * CONTEXT // PAGE
    q_idx = torch.randn(B, 1, HEADS, DIM).to(FP8)
    k_cache = torch.zeros(pages, PAGE, 1, DIM + 4, dtype=torch.uint8)
    weights = torch.randn(B, HEADS)
    ctx = torch.full((B,), CONTEXT, dtype=torch.int32)
    table = torch.arange(pages, dtype=torch.int32).view(B, -1)
    meta = torch.zeros(133, 2, dtype=torch.int32)
    logits = torch.randn(B, CONTEXT)
    q = torch.randn(B, 1, HEADS, 576).bfloat16()
    kv_cache = torch.zeros(64, PAGE, 656, dtype=torch.uint8)
    idx = torch.randint(0, 64 * PAGE, (B, 1, TOPK), dtype=torch.int32)

    indexer._fp8_paged_mqa_logits_op = lambda *a: None
    indexer._paged_metadata_op = lambda *a: None
    topk._topk_indices_op = lambda *a: None
    sparse_mla._sparse_decode_op = lambda *a: None
    calls = {
        "get_paged_mqa_logits_metadata": lambda: nb.get_paged_mqa_logits_metadata(ctx, PAGE, 132),
        "fp8_paged_mqa_logits": lambda: nb.fp8_paged_mqa_logits(q_idx, k_cache, weights, ctx, table, meta, CONTEXT),
        "topk_indices": lambda: nb.topk_indices(logits, TOPK),
        "sparse_mla_decode": lambda: nb.sparse_mla_decode(q, kv_cache, idx, 0.1),
    }
    print("| op | validation + routing, us per call |")
    print("|---|---|")
    for name, fn in calls.items():
        print(f"| {name} | {_time_us(fn):.1f} |")


if __name__ == "__main__":
    main()
