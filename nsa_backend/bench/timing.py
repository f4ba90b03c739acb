"""Timing of one callable: median milliseconds per call.

``bench_ms(fn)`` is what every benchmark module times with, so all rows of one run are measured
the same way:

- CUDA, ``flush_l2=True`` (default): CUDA events around every call, and before every call a
  256 MiB buffer is *read* (summed), which leaves the L2 cache full of clean lines of that
  buffer: every call starts cold. Zeroing the buffer instead (what ``triton.testing.do_bench``
  does) leaves the L2 full of dirty lines, and the timed call then also pays for writing them
  back to memory: up to ~60 MB of extra traffic, about 15 us on an H200, which is most of the
  time of a call that reads 60 MB. ``flush_l2="write"`` times that way, for comparison.
- CUDA, ``flush_l2=False``: CUDA events without the cache clear (warm-L2 numbers).
- CPU: ``time.perf_counter`` around every call, median.
- ``graph=True`` (CUDA): ``fn`` is captured once in a CUDA graph and the replay is timed, which is
  how SGLang and vLLM run decode steps; host-side launch costs (validation, routing, Python) then
  drop out and the number is the GPU time of the captured kernels.

``warmup`` and ``rep`` are time budgets in milliseconds, as in ``triton.testing.do_bench``: the
number of calls follows from a first estimate of one call's time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_WARMUP_MS = 25.0
DEFAULT_REP_MS = 100.0
# Bytes read before every timed call to evict the L2 cache (H200: 60 MiB of L2).
L2_FLUSH_BYTES = 256 * 1024 * 1024
# Bounds on the number of timed calls, so tiny CPU functions and slow references both finish.
MAX_CALLS = 1000
ESTIMATE_CALLS = 5


def _on_cuda(device: str | torch.device | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def bench_ms(
    fn: Callable[[], Any],
    warmup: float = DEFAULT_WARMUP_MS,
    rep: float = DEFAULT_REP_MS,
    *,
    flush_l2: bool | str = True,
    device: str | torch.device | None = None,
    graph: bool = False,
) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    Parameters
    ----------
    fn : callable
        Called without arguments; it should launch the work to time (CUDA calls may be async).
    warmup : float
        Warm-up budget in ms (at least one call).
    rep : float
        Budget of the timed calls in ms (at least one call, at most ``MAX_CALLS``).
    flush_l2 : bool or {"read", "write"}
        CUDA only: evict the L2 cache before every timed call (cold-cache numbers). ``True`` or
        ``"read"`` evicts by reading a large buffer; ``"write"`` by zeroing it (dirty lines that
        the timed call writes back).
    device : str or torch.device, optional
        Where ``fn`` runs; ``None`` means CUDA when available, else CPU.
    graph : bool
        CUDA only: time the replay of ``fn`` captured in a CUDA graph.

    Returns
    -------
    float
        Median milliseconds per call.
    """
    if not (isinstance(flush_l2, bool) or flush_l2 in ("read", "write")):
        raise ValueError(f"flush_l2 must be True, False, 'read' or 'write', got {flush_l2!r}")
    if not _on_cuda(device):
        return _bench_cpu(fn, warmup, rep)
    if graph:
        fn = cuda_graph_replay(fn)
    mode = "read" if flush_l2 is True else (flush_l2 or None)
    return _bench_cuda_events(fn, warmup, rep, mode)


def cuda_graph_replay(fn: Callable[[], Any], warmup_calls: int = 2) -> Callable[[], Any]:
    """Capture ``fn`` in a CUDA graph (after warm-up calls on a side stream); return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _bench_cpu(fn: Callable[[], Any], warmup: float, rep: float) -> float:
    fn()  # first call: one-time costs (imports, allocator, op registration) stay out of the estimate
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e3
    estimate = max(first, 1e-4)
    n_warmup = min(MAX_CALLS, int(warmup / estimate))
    for _ in range(n_warmup):
        fn()
    n = max(1, min(MAX_CALLS, int(rep / estimate)))
    # A call too slow to repeat within the budgets counts the estimate as a timed call.
    times = [first] if n_warmup == 0 else []
    for _ in range(n - len(times)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _bench_cuda_events(fn: Callable[[], Any], warmup: float, rep: float, flush: str | None) -> float:
    cache = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda") if flush else None

    def clear() -> None:
        if cache is None:
            return
        if flush == "write":
            cache.zero_()
        else:
            cache.sum()

    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ESTIMATE_CALLS):
        clear()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / ESTIMATE_CALLS, 1e-4)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, min(MAX_CALLS, int(rep / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        clear()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


def tflops(flops: float | None, ms: float | None) -> float | None:
    """TFLOP/s of ``flops`` floating-point operations done in ``ms`` milliseconds."""
    if flops is None or not ms:
        return None
    return flops / ms / 1e9


def gbps(nbytes: float | None, ms: float | None) -> float | None:
    """GB/s (10^9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    if nbytes is None or not ms:
        return None
    return nbytes / ms / 1e6
