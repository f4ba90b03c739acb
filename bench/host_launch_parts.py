"""Host time of the parts of one replayed eager decode-path call on a GPU, in one process.

For the decode-path ops at the eager family's shapes (``nsa_backend/bench/eager.py``, ``impl="triton"``):
first, over several rounds, the public op beside FlashMLA's decode call (the anchor of the eager family,
when ``flash_mla`` imports) and a ``torch.empty``; then, per recorded call (``nsa_backend/_replay.py``),
the replay alone, its allocations, each of its kernel launches (Triton's compiled launcher) and, for
the ops it keys, the signature key. Median microseconds of 300 calls, the GPU idle at each::

    python bench/host_launch_parts.py
    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0 python bench/host_launch_parts.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from nsa_backend import _replay, indexer, sparse_mla, topk
from nsa_backend.bench import eager
from nsa_backend.bench import sparse_mla as bench_sparse_mla

OPS = ("sparse_mla_decode", "fp8_paged_mqa_logits", "topk_indices", "get_paged_mqa_logits_metadata")
CACHES = {"sparse_mla_decode": sparse_mla._decode_replays, "fp8_paged_mqa_logits": indexer._paged_logits_replays,
          "topk_indices": topk._topk_replays, "get_paged_mqa_logits_metadata": indexer._metadata_replays}
ROUNDS = 4


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _anchor(dev: torch.device) -> Callable[[], Any] | None:
    fm = bench_sparse_mla._flash_mla(host_only=True)
    if fm is None:
        return None
    a = bench_sparse_mla.decode_inputs(32, 1, 64, eager.TOPK, dev)
    sched, _ = fm.get_mla_metadata()
    kw = bench_sparse_mla._legacy(fm.flash_mla_with_kvcache)
    return lambda: fm.flash_mla_with_kvcache(a["q"], a["kv_cache"], None, None, 512, sched, None,
                                             softmax_scale=a["sm_scale"], causal=False, is_fp8_kvcache=True,
                                             indices=a["indices"], **kw)


def _recorded_values(cases: dict[str, Any]) -> dict[str, tuple[_replay.Replay, tuple[Any, ...]]]:
    """Per op, its replay and the arguments of the eager family's call (seen on the next call)."""
    seen: dict[str, tuple[_replay.Replay, tuple[Any, ...]]] = {}
    own = _replay.Replay.__call__
    for op in CACHES:
        def spy(self, values, _op=op):
            seen[_op] = (self, values)
            return own(self, values)
        _replay.Replay.__call__ = spy
        try:
            cases[op][1]("triton")
        finally:
            _replay.Replay.__call__ = own
    return seen


def main() -> int:
    if not torch.cuda.is_available():
        print("host_launch_parts.py: it times launches on a GPU: no CUDA device is visible", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cases = eager._cases(dev, quick=False)
    anchor = _anchor(dev)
    for _ in range(ROUNDS):
        row = [f"flash_mla decode {host_us(anchor):.1f}" if anchor else "no flash_mla",
               f"torch.empty {host_us(lambda: torch.empty(32, 1, 64, 512, dtype=torch.bfloat16, device=dev)):.1f}"]
        row += [f"{op} {host_us(lambda op=op: cases[op][1]('triton')):.1f}" for op in OPS]
        print(" | ".join(row), flush=True)
    for op, (replay, values) in _recorded_values(cases).items():
        slots = [*values, *(torch.empty_strided(s, st, dtype=d, device=dv) for s, st, d, dv in replay.allocations)]

        def allocate(r=replay):
            for size, stride, dtype, device in r.allocations:
                torch.empty_strided(size, stride, dtype=dtype, device=device)

        parts = [f"== {op}: replay {host_us(lambda r=replay, v=values: r(v)):.1f}",
                 f"{len(replay.allocations)} allocations {host_us(allocate):.1f}"]
        parts += [f"launch {i} ({len(launch.args)} args) {host_us(lambda x=launch, s=slots: x(s)):.1f}"
                  for i, launch in enumerate(replay.launches)]
        cache = CACHES[op]
        parts.append(f"signature key {host_us(lambda c=cache, v=values: c.key(v)):.1f}")
        print(" | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
