"""GPU kernel time next to event time, for the rows whose targets are ratios to the copy rate or to
a native kernel: ``python -m nsa_backend.bench.kernel_time [--quick] [--out PREFIX]``.

:func:`nsa_backend.bench.timing.bench_ms` (what the suite reports) records CUDA events around each
call, here the replay of the call captured in a CUDA graph, after evicting the L2 cache. That time
holds a fixed cost per call besides the kernels: on an H200 an empty kernel measures 2.8-4.2 us
that way, while the kernel itself runs for about 0.6 us. For a call of 20 us that cost is up to a
fifth of the time, which the copy rate it is compared with (a 2 GiB copy) does not carry.

:func:`kernel_span_ms` times the same graph replays with the profiler (``torch.profiler``, i.e.
CUPTI's record of each kernel's start and end on the GPU) and takes, per call, the span from its
first kernel's start to its last kernel's end; gaps between the kernels of one call count, the
launch of the call does not. DeepGEMM's tests time these ops by kernel duration the same way.

The rows, each timed both ways in one process:

- the copy rate (a device-to-device ``copy_`` of 2 GiB, as ``nsa_backend.bench.limits``) and an
  empty kernel (the fixed cost);
- ``fp8_paged_mqa_logits`` (B 128, H 64, D 128, contexts 4K..64K, next_n 1 and 2), a pure read of
  the same pages and that read with the op's logits written (``read_kv_logits``), as bytes of KV per
  second over the copy rate;
- ``tf32_hc_prenorm_gemm`` (N 24, K 28672, M 1024..16384) and a pure read of ``a``, as bytes of ``a``
  per second over the copy rate;
- ``sparse_mla_decode`` (fp8_ds_mla, top-k 2048, B 32 and 128, s_q 1 and 2, h_q 16 / 32 / 64 / 128)
  against FlashMLA (heads padded to 64 where it has no kernel for h_q), when it imports.

Ratios against the copy rate use the copy rate timed the same way as the row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from nsa_backend.bench.timing import bench_ms, cuda_graph_replay

# Bytes read before every profiled call to evict the L2 cache (as bench_ms does).
EVICT_BYTES = 256 * 1024 * 1024
EVICT_BLOCK = 8192
# Profiled calls per row (the median span is reported).
CALLS = 30


@triton.jit
def _kernel_time_evict_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Reads BLOCK int32 words per program and stores their xor: the L2 ends up full of clean lines.
    # Its name marks the boundary between two profiled calls.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.load(x_ptr + o, mask=o < n, other=0), axis=0))


EVICT_KERNEL_NAME = "_kernel_time_evict_kernel"


@triton.jit
def _kernel_time_empty_kernel(x_ptr):
    pass


class _Evictor:
    """Evicts the L2 cache by reading a buffer with a kernel whose name no timed op uses."""

    def __init__(self, device: torch.device):
        self.buf = torch.zeros(EVICT_BYTES // 4, dtype=torch.int32, device=device)
        self.out = torch.empty(triton.cdiv(self.buf.numel(), EVICT_BLOCK), dtype=torch.int32, device=device)

    def __call__(self) -> None:
        grid = (self.out.numel(),)
        _kernel_time_evict_kernel[grid](self.buf, self.out, self.buf.numel(), BLOCK=EVICT_BLOCK, num_warps=8)


def call_spans(events: Iterable[tuple[str, int, int]], marker: str = EVICT_KERNEL_NAME) -> list[float]:
    """Milliseconds from the first kernel's start to the last kernel's end of every call.

    Parameters
    ----------
    events : iterable of (name, start_ns, end_ns)
        GPU activities of a profile in which every call follows one ``marker`` kernel (the L2
        eviction); any order.
    marker : str
        Name (or a prefix of the mangled name) of the kernel that separates the calls.

    Returns
    -------
    list of float
        One span per call that ran at least one kernel between two markers (or after the last);
        activities before the first marker are ignored.
    """
    spans: list[float] = []
    start = end = None
    seen_marker = False
    for name, t0, t1 in sorted(events, key=lambda e: (e[1], e[2])):
        if name.startswith(marker):
            if start is not None:
                spans.append((end - start) / 1e6)
            start = end = None
            seen_marker = True
        elif seen_marker:
            start = t0 if start is None else start
            end = t1 if end is None else max(end, t1)
    if start is not None:
        spans.append((end - start) / 1e6)
    return spans


def _gpu_events(prof: torch.profiler.profile) -> list[tuple[str, int, int]]:
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns())
            for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]


def kernel_span_ms(fn: Callable[[], Any], calls: int = CALLS, graph: bool = True,
                   evict: Callable[[], None] | None = None) -> float:
    """Median GPU span of one call of ``fn`` (see the module docstring), the L2 evicted before each.

    Parameters
    ----------
    fn : callable
        Launches the work to time on the current CUDA device.
    calls : int
        Profiled calls.
    graph : bool
        Time the replay of ``fn`` captured in a CUDA graph (as ``bench_ms(graph=True)``).
    evict : callable, optional
        The L2 eviction (an :class:`_Evictor`); one is made when ``None``.

    Returns
    -------
    float
        Milliseconds. Raises ``RuntimeError`` when the profiler recorded no kernel for the calls.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_span_ms needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    evict = evict or _Evictor(torch.device("cuda", torch.cuda.current_device()))
    run = cuda_graph_replay(fn) if graph else fn
    for _ in range(3):
        evict()
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            evict()
            run()
        evict()
        torch.cuda.synchronize()
    spans = call_spans(_gpu_events(prof))
    if len(spans) < calls // 2:
        raise RuntimeError(f"the profiler recorded kernels for {len(spans)} of {calls} calls")
    return float(statistics.median(spans))


def _both(fn: Callable[[], Any], evict: _Evictor, graph: bool = True) -> dict[str, float]:
    return {"event_ms": bench_ms(fn, graph=graph), "kernel_ms": kernel_span_ms(fn, graph=graph, evict=evict)}


def _row(group: str, shape: str, impl: str, times: dict[str, float], nbytes: float | None = None) -> dict[str, Any]:
    return {"group": group, "shape": shape, "impl": impl, **times, "bytes": nbytes}


def _limits(evict: _Evictor) -> list[dict[str, Any]]:
    n = 2 * 2**30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy = _row("limit", "2 GiB", "copy", _both(lambda: dst.copy_(src), evict, graph=False), 2.0 * n)
    x = torch.zeros(1, device="cuda")
    empty = _row("limit", "1 program", "empty kernel", _both(lambda: _kernel_time_empty_kernel[(1,)](x), evict))
    return [copy, empty]


def _paged_case(evict: _Evictor, L: int, next_n: int) -> list[dict[str, Any]]:
    import nsa_backend as nb
    from nsa_backend.bench.indexer import paged_inputs, read_kv_pages
    from nsa_backend.kernels._arch import device_sms

    q, cache, w, ctx, table = paged_inputs(128, L, next_n, 64, 128)
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, device_sms(q.device), impl="triton")
    shape = f"B=128 context={L} next_n={next_n} H=64"
    kv_bytes = 128.0 * L * 132

    def ours() -> torch.Tensor:
        return nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, L, impl="triton")

    logits = torch.empty(128, next_n, L, dtype=torch.float32, device="cuda")
    return [_row("fp8_paged_mqa_logits", shape, "triton", _both(ours, evict), kv_bytes),
            _row("fp8_paged_mqa_logits", shape, "read_kv", _both(lambda: read_kv_pages(cache, table), evict), kv_bytes),
            _row("fp8_paged_mqa_logits", shape, "read_kv_logits",
                 _both(lambda: read_kv_pages(cache, table, logits), evict), kv_bytes)]


def _paged_rows(evict: _Evictor, quick: bool) -> list[dict[str, Any]]:
    lengths = (4096, 8192) if quick else (4096, 8192, 16384, 32768, 65536)
    rows = []
    for next_n in (1, 2):
        for L in lengths:
            rows += _paged_case(evict, L, next_n)
            torch.cuda.empty_cache()
    return rows


def _mhc_case(evict: _Evictor, m: int) -> list[dict[str, Any]]:
    import nsa_backend as nb
    from nsa_backend.bench.mhc import _read_a

    a = torch.randn(m, 28672, device="cuda").to(torch.bfloat16)
    b = torch.randn(24, 28672, device="cuda") / 28672**0.5
    d = torch.empty(m, 24, device="cuda")
    sq = torch.empty(m, device="cuda")
    shape = f"M={m} N=24 K=28672"
    return [_row("tf32_hc_prenorm_gemm", shape, "triton",
                 _both(lambda: nb.tf32_hc_prenorm_gemm(a, b, d, sq, impl="triton"), evict), a.numel() * 2.0),
            _row("tf32_hc_prenorm_gemm", shape, "read_a", _both(lambda: _read_a(a, b, d, sq), evict), a.numel() * 2.0)]


def _mhc_rows(evict: _Evictor, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for m in (1024, 2048) if quick else (1024, 2048, 4096, 8192, 16384):
        rows += _mhc_case(evict, m)
        torch.cuda.empty_cache()
    return rows


def _decode_case(evict: _Evictor, B: int, s_q: int, h_q: int) -> list[dict[str, Any]]:
    from nsa_backend.bench import sparse_mla as bs
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

    dev = torch.device("cuda", torch.cuda.current_device())
    a = bs.decode_inputs(B, s_q, h_q, 2048, dev)
    shape = f"B={B} s_q={s_q} h_q={h_q} topk=2048 fp8_ds_mla"

    def ours() -> torch.Tensor:
        return sparse_mla_decode_triton(a["q"], a["kv_cache"], a["indices"], a["sm_scale"],
                                        kv_scale_format=bs.DECODE_SCALE_FORMAT)

    rows = [_row("sparse_mla_decode", shape, "triton", _both(ours, evict))]
    flash = bs._flash_mla_with_q(a["q"], 2, h_q, dev)
    if flash is None:
        return rows
    fm, qp, name = flash
    sched, _ = fm.get_mla_metadata()
    kw = bs._legacy(fm.flash_mla_with_kvcache)

    def native() -> Any:
        return fm.flash_mla_with_kvcache(qp, a["kv_cache"], None, None, bs.D_V, sched, None,
                                         softmax_scale=a["sm_scale"], causal=False, is_fp8_kvcache=True,
                                         indices=a["indices"], **kw)

    return [*rows, _row("sparse_mla_decode", shape, name, _both(native, evict))]


def _decode_rows(evict: _Evictor, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for h_q in (16,) if quick else (16, 32, 64, 128):
        for B in (32, 128):
            for s_q in (1, 2):
                rows += _decode_case(evict, B, s_q, h_q)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``of_copy_<event|kernel>`` (rows with bytes) and ``vs_<impl>_<event|kernel>`` (time of the other
    implementations of the same shape over ``triton``'s) in place."""
    copy = next((r for r in rows if r["group"] == "limit" and r["impl"] == "copy"), None)
    for r in rows:
        for how in ("event", "kernel"):
            t = r.get(f"{how}_ms")
            if copy and r["bytes"] and r["group"] != "limit" and t:
                rate = r["bytes"] / t
                r[f"of_copy_{how}"] = rate / (copy["bytes"] / copy[f"{how}_ms"])
    for r in rows:
        if r["impl"] != "triton":
            continue
        for other in rows:
            if other is r or other["group"] != r["group"] or other["shape"] != r["shape"] or other["bytes"]:
                continue
            for how in ("event", "kernel"):
                if other.get(f"{how}_ms") and r.get(f"{how}_ms"):
                    r[f"vs_{other['impl']}_{how}"] = other[f"{how}_ms"] / r[f"{how}_ms"]


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """One table: times both ways and the ratios of :func:`add_ratios`."""
    lines = ["| op | shape | impl | event us | kernel us | ratios (event / kernel) |", "|---|---|---|---|---|---|"]
    for r in rows:
        pairs = sorted({k.rsplit("_", 1)[0] for k in r if k.startswith(("of_copy_", "vs_"))})
        ratios = ", ".join(f"{p} {r.get(p + '_event', float('nan')):.3f} / {r.get(p + '_kernel', float('nan')):.3f}"
                           for p in pairs)
        lines.append(f"| {r['group']} | {r['shape']} | {r['impl']} | {r['event_ms'] * 1e3:.2f} | "
                     f"{r['kernel_ms'] * 1e3:.2f} | {ratios} |")
    return "\n".join(lines) + "\n"


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every row (see the module docstring), timed both ways, with ratios. Needs CUDA."""
    evict = _Evictor(torch.device("cuda", torch.cuda.current_device()))
    rows = _limits(evict)
    for part in (_paged_rows, _mhc_rows, _decode_rows):
        new = part(evict, quick)
        for r in new:
            print(f"{r['group']} {r['shape']} {r['impl']}: event {r['event_ms'] * 1e3:.2f} us, "
                  f"kernel {r['kernel_ms'] * 1e3:.2f} us", flush=True)
        rows += new
    add_ratios(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_backend.bench.kernel_time", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    parser.add_argument("--git-commit", default=None, help="commit recorded with the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_time: needs a CUDA device (the profiler's record of GPU kernels); nothing measured")
        return 0
    rows = run(args.quick)
    text = to_markdown(rows)
    print(text)
    if args.out:
        cli = sys.argv[1:] if argv is None else list(argv)
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "commit": args.git_commit}
        command = "python -m nsa_backend.bench.kernel_time " + " ".join(cli)
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command, "environment": env, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"`{command}` on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, commit "
                    f"{env['commit']})\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
