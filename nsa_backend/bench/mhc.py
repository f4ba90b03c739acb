"""Benchmark of the mHC pre-norm GEMM ``tf32_hc_prenorm_gemm`` (DeepSeek-V4).

The op is bound by reading ``a`` (``M x K`` bf16), so the figure of merit is the bytes of ``a``
read per second (``gbps``) over the device-to-device copy bandwidth of the same run
(``ratios["of_copy"]``); ``ratios["vs_torch"]`` is the plain torch computation's time over ours
(``d = a.float() @ b.T``; ``sqr_sum = a.float().pow(2).sum(-1)``). ``triton`` is the public op
(validation, routing), ``triton_impl`` the implementation function it calls: when the GPU work is
shorter than the host work per call, the public-op row shows the host time. vLLM runs the op inside
CUDA graphs, so ``triton-graph`` and ``torch-graph`` time the replay of the captured public op and
of the torch computation (GPU time only; ``vs_torch`` of a graph row compares with ``torch-graph``).
``read_a`` (and ``read_a-graph``) is a pure streaming read of ``a`` timed the same way: the fastest
any kernel reading ``a`` once can be at that size, so ``ratios["vs_read_a"]`` of a Triton row is its
share of the attainable speed. DeepGEMM is timed when its native module is importable.

Run on a GPU and write ``<out>/mhc.json`` and ``<out>/mhc.md``::

    python -m nsa_backend.bench.mhc --out bench/results/h200
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from nsa_backend.bench import proxy
from nsa_backend.bench.timing import bench_ms

FAMILY = "mhc"
OP = "tf32_hc_prenorm_gemm"
# (M, N, K, num_splits); DeepSeek-V4: N = 24, K = 4 * hidden (hidden 7168 -> 28672).
FULL_SHAPES: tuple[tuple[int, int, int, int | None], ...] = (
    (1, 24, 28672, None),
    (64, 24, 28672, None),
    (256, 24, 28672, None),
    (1024, 24, 28672, None),
    (2048, 24, 28672, None),
    (4096, 24, 28672, None),
    (8192, 24, 28672, None),
    (16384, 24, 28672, None),
    (1024, 24, 28672, 16),
    (4096, 24, 7168, None),
    (4096, 32, 28672, None),
    (4096, 128, 28672, None),
)
QUICK_SHAPES: tuple[tuple[int, int, int, int | None], ...] = (
    (64, 24, 28672, None),
    (1024, 24, 28672, None),
    (4096, 24, 28672, None),
)
CPU_SHAPES: tuple[tuple[int, int, int, int | None], ...] = ((16, 24, 256, None),)
# Also timed as CUDA-graph replays (rows "<impl>-graph").
GRAPH_IMPLS: tuple[str, ...] = ("triton", "torch", "read_a")
GRAPH_SUFFIX = "-graph"


def _torch_baseline(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, sqr_sum: torch.Tensor) -> None:
    af = a.float()
    torch.matmul(af, b.T, out=d)
    torch.sum(af.pow(2), -1, out=sqr_sum)


# Pure read of ``a``: a streaming sum over its elements, timed like the op (same L2 flush, same CUDA
# graph). No kernel that reads ``a`` once can be faster, so ``vs_read_a`` (the read's time over the
# op's) is the share of the attainable speed at this size; for small ``a`` it sits well below the
# 2 GiB copy rate because ramp-up and the cache flush cost the same per call.
READ_BLOCK = 4096
READ_ITERS = 16


@triton.jit
def _read_a_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    i_p = tl.program_id(0)
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        o = i_p.to(tl.int64) * BLOCK * ITERS + i * BLOCK + tl.arange(0, BLOCK)
        b_acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_p, tl.sum(b_acc, axis=0))


def _read_a(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, sqr_sum: torch.Tensor) -> None:
    n = a.numel()
    grid = (triton.cdiv(n, READ_BLOCK * READ_ITERS),)
    out = torch.empty(grid[0], dtype=torch.float32, device=a.device)
    _read_a_kernel[grid](a, out, n, BLOCK=READ_BLOCK, ITERS=READ_ITERS, num_warps=8)


def _impls(num_splits: int | None) -> dict[str, Callable[..., None]]:
    from nsa_backend.kernels.mhc import tf32_hc_prenorm_gemm_triton
    from nsa_backend.mhc import tf32_hc_prenorm_gemm

    out: dict[str, Callable[..., None]] = {
        "triton": lambda a, b, d, s: tf32_hc_prenorm_gemm(a, b, d, s, num_splits, impl="triton"),
        "triton_impl": lambda a, b, d, s: tf32_hc_prenorm_gemm_triton(a, b, d, s, num_splits),
    }
    if num_splits is None:
        out["torch"] = _torch_baseline
        out["read_a"] = _read_a
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        pass
    else:
        if proxy.active():  # the proxy times the proxied arch's route: natives off
            return out
        out["deep_gemm"] = lambda a, b, d, s: tf32_hc_prenorm_gemm(a, b, d, s, num_splits, impl="deep_gemm")
    return out


def _shape_str(m: int, n: int, k: int, s: int | None) -> str:
    return f"M={m} N={n} K={k}" + (f" splits={s}" if s is not None else "")


def run(quick: bool, limits: dict[str, Any]) -> list[dict[str, Any]]:
    """Time every implementation on the benchmark shapes; one row per (shape, impl)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
            from nsa_backend.bench import builtin

            return builtin.run("mhc", quick, limits)
        shapes = CPU_SHAPES
    else:
        shapes = QUICK_SHAPES if quick else FULL_SHAPES
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        rows += _time_shape(*shape, device, limits.get("copy_gbps"))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_shape(m: int, n: int, k: int, s: int | None, device: str, copy_gbps: float | None) -> list[dict]:
    a = torch.randn(m, k, device=device).to(torch.bfloat16)
    b = torch.randn(n, k, device=device) / k**0.5
    d = torch.empty((m, n) if s is None else (s, m, n), device=device)
    sq = torch.empty((m,) if s is None else (s, m), device=device)
    times: dict[str, float] = {}
    for name, fn in _impls(s).items():
        for graph in (False, True) if device == "cuda" and name in GRAPH_IMPLS else (False,):
            key = name + GRAPH_SUFFIX if graph else name
            try:
                times[key] = bench_ms(lambda fn=fn: fn(a, b, d, sq), device=device, graph=graph)
            except Exception as exc:  # one failing implementation must not end the benchmark
                print(f"{FAMILY}: {key} failed on {_shape_str(m, n, k, s)}: {exc}", file=sys.stderr)
    a_bytes = a.numel() * a.element_size()
    rows = []
    for name, ms in times.items():
        gbps = a_bytes / ms / 1e6
        ratios: dict[str, float] = {}
        if copy_gbps:
            ratios["of_copy"] = gbps / copy_gbps
        if name.startswith("triton"):
            suffix = GRAPH_SUFFIX if name.endswith(GRAPH_SUFFIX) else ""
            for other in ("torch", "deep_gemm", "read_a"):
                if other + suffix in times:
                    ratios[f"vs_{other}"] = times[other + suffix] / ms
        rows.append({
            "family": FAMILY, "op": OP, "shape": _shape_str(m, n, k, s), "impl": name, "ms": ms,
            "tflops": 2.0 * m * n * k / ms / 1e9, "gbps": gbps, "ratios": ratios,
        })
    return rows


# Candidate tiles timed by :func:`sweep` for N <= 32 (the shipped tables are nsa_backend/configs/mhc.py):
# b read as fp32, and (bf16x3 only) b split into stacked bf16 parts first.
SWEEP_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (128, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3), (128, 64, 4, 6), (64, 64, 4, 6),
    (128, 128, 4, 3),
)
SWEEP_PARTS_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((128, 64, 8, 6), (128, 64, 8, 4), (64, 64, 4, 6))
SWEEP_SHAPES: tuple[tuple[int, int, int, int | None], ...] = (
    (64, 24, 28672, None), (1024, 24, 28672, None), (4096, 24, 28672, None), (16384, 24, 28672, None),
)


def sweep(shapes: tuple[tuple[int, int, int, int | None], ...] = SWEEP_SHAPES) -> list[dict[str, Any]]:
    """Time candidate tiles x split-K plans x precisions of the kernel (for tuning the tables)."""

    rows = []
    for shape in shapes:
        rows += _sweep_shape(*shape)
        torch.cuda.empty_cache()
    return rows


def _sweep_shape(m: int, n: int, k: int, s: int | None) -> list[dict[str, Any]]:
    from nsa_backend.configs import mhc as cfgs
    from nsa_backend.kernels import mhc as kern

    arch, sms = kern._arch_and_sms(torch.device("cuda"))
    splits = 1 if s is None else s
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda")
    d = torch.empty(splits, m, n, device="cuda")
    sq = torch.empty(splits, m, device="cuda")
    block_n = cfgs.block_n_for(n)
    seen = set()
    rows = []
    candidates = [(tile, False) for tile in SWEEP_CONFIGS]
    if block_n == cfgs.PARTS_BLOCK_N:
        candidates += [(tile, True) for tile in SWEEP_PARTS_CONFIGS]
    for tile, b_parts in candidates:
        cfg = cfgs.GemmConfig(*tile)
        if cfg.shared_bytes_estimate(block_n, b_parts) > cfgs.shared_memory_budget(arch):
            continue
        bm = min(cfg.block_m, max(16, _next_pow2(m)))
        for per_sm in (1, 2, 4, 8):
            for min_chunk in (512, 1024, 2048):
                plan = kern.split_plan(m, n, k, splits, bm, cfg.block_k, sms, per_sm, min_chunk)
                for precision in cfgs.PRECISIONS:
                    key = (tile, b_parts, plan, precision)
                    if key in seen or (precision != cfgs.DEFAULT_PRECISION and (b_parts or tile != SWEEP_CONFIGS[0])):
                        continue
                    seen.add(key)
                    run_cfg = cfgs.GemmConfig(bm, *tile[1:])

                    def fn(c=run_cfg, p=plan, pr=precision, bp=b_parts):
                        kern._launch(a, b, d, sq, splits, block_n, c, p, pr, bp)

                    try:
                        ms = bench_ms(fn, 5, 30)
                    except Exception as exc:  # a candidate that fails to compile is reported, not fatal
                        print(f"sweep: {tile} {plan} failed: {exc}", file=sys.stderr)
                        continue
                    rows.append({"shape": _shape_str(m, n, k, s), "config": list(tile), "b_parts": b_parts,
                                 "plan": list(plan),
                                 "programs_per_sm": per_sm, "min_chunk_k": min_chunk,
                                 "precision": precision, "ms": ms, "gbps": m * k * 2 / ms / 1e6})
    return rows


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# {OP} benchmark", "", f"Command: `{result['command']}`", "",
             f"Device: {result['device']}; torch {result['torch']}; triton {result['triton']}", "",
             "Limits: " + ", ".join(f"{k} = {v:.1f}" for k, v in result["limits"].items() if v is not None), "",
             "| shape | impl | us | a GB/s | a read / copy BW | speed-up vs torch |",
             "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        copy = r["ratios"].get("of_copy")
        vs = r["ratios"].get("vs_torch")
        lines.append(f"| {r['shape']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | "
                     f"{'' if copy is None else f'{copy:.2f}'} | {'' if vs is None else f'{vs:.2f}x'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate configuration")
    parser.add_argument("--out", type=Path, default=None, help="folder for mhc.json and mhc.md")
    args = parser.parse_args(argv)
    import triton

    from nsa_backend.bench.limits import measure_limits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    limits = measure_limits(device, args.quick)
    result: dict[str, Any] = {
        "command": "python -m nsa_backend.bench.mhc " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__,
        "limits": limits, "rows": run(args.quick, limits),
    }
    if device == "cuda":
        result["plans"] = _plans(QUICK_SHAPES if args.quick else FULL_SHAPES)
    _write(result, args.out)
    if args.sweep and device == "cuda":
        result["sweep"] = sweep()
        _write(result, args.out)


def _plans(shapes: tuple[tuple[int, int, int, int | None], ...]) -> dict[str, str]:
    """The configuration and split-K plan the Triton path uses for each shape on this GPU."""
    from nsa_backend.kernels import mhc as kern

    index = torch.cuda.current_device()
    out = {}
    for m, n, k, s in shapes:
        block_n, cfg, plan, b_parts = kern._plan(m, n, k, s or 1, index)
        out[_shape_str(m, n, k, s)] = (f"block_n={block_n} {cfg} b_parts={b_parts} "
                                       f"(split_k, chunk_k, num_chunks)={plan}")
    return out


def _write(result: dict[str, Any], out: Path | None) -> None:
    text = _markdown(result)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{FAMILY}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{FAMILY}.md").write_text(text)

if __name__ == "__main__":
    main()
