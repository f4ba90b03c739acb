"""Roofline share of benchmark rows whose op is bounded by both memory and compute.

A row's ``of_copy`` (GB/s over the copy rate) or ``of_fp8_mm`` / ``of_bf16_mm`` (TFLOP/s over a matmul
rate) alone understates an op that needs both: the paged indexer logits do ``2 * H * D`` useful FLOPs
per (query row, visible key), 16384 at ``H = 64``, ``D = 128``, against ``D + 4 = 132`` bytes per key, so
where the matmul rate is low (the mma.sync proxy) even a perfect kernel stays well below the copy rate.
A kernel running at the measured limits needs

    t_ideal = max(bytes / copy_gbps, flops / peak_tflops)

and ``of_roofline = t_ideal / ms = max(of_copy, compute fraction)`` is the row's share of that
(:func:`of_roofline`); 1 means a kernel at the limits. :func:`ceiling_of_copy` is the highest
``of_copy`` the limits allow, ``min(1, (bytes / copy) / (flops / peak))``, for comparing a target
stated against the copy rate with what is attainable.

Run on a results file (no GPU needed)::

    python -m nsa_backend.bench.roofline bench/results/h200-proxy-sm120 --out roofline.md

writes a markdown table of every row of the ops in :data:`ROOFLINE_OPS` with a time and a rate. Rows
of the paged logits that carry no TFLOP/s (results written before the indexer family counted FLOPs)
get their FLOPs from the shape (:func:`paged_logits_flops`). The limits are those of the run that
measured each family: a results file merged from several runs keeps every family's ratios against
its own run, so each family's limits are read back from its rows (rate / ratio) and the file's
``limits`` serve only where a family's rows carry no such ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nsa_backend.bench.schema import validate

# Ops bounded by a memory and a compute limit, and the compute limit of each: the indexer logits
# multiply e4m3 queries by e4m3 (or e2m1 widened to e4m3) keys, the sparse MLA decode runs bf16 MMAs.
# The DeepSeek-V4 decode is ``sparse_mla_decode`` with ``kv_format="fp8_ds_mla_v4"`` (peers family).
ROOFLINE_OPS: dict[str, str] = {
    "fp8_paged_mqa_logits": "fp8_tflops",
    "fp8_fp4_paged_mqa_logits": "fp8_tflops",
    "sparse_mla_decode": "bf16_tflops",
}
# Ops whose FLOPs follow from the shape with :func:`paged_logits_flops` (both use the same visibility).
PAGED_LOGITS_OPS: tuple[str, ...] = ("fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits")

MEMORY_RATIO = "of_copy"
# Compute ratios, the same names the runner gives them (``runner.LIMIT_RATIO``).
COMPUTE_RATIOS: dict[str, str] = {"bf16_tflops": "of_bf16_mm", "fp8_tflops": "of_fp8_mm"}
_LIMIT_LABEL: dict[str, str] = {"copy_gbps": "copy", "bf16_tflops": "bf16 mm", "fp8_tflops": "fp8 mm"}
_RATE_OF_LIMIT: dict[str, tuple[str, str]] = {
    "copy_gbps": ("gbps", MEMORY_RATIO),
    "bf16_tflops": ("tflops", COMPUTE_RATIOS["bf16_tflops"]),
    "fp8_tflops": ("tflops", COMPUTE_RATIOS["fp8_tflops"]),
}
# Rate / ratio of a family's rows must agree this closely to be read as one measured limit.
_SAME_LIMIT_RTOL = 1e-9
PROG = "python -m nsa_backend.bench.roofline"


# ----------------------------------------------------------------------------------------------
# The numbers
# ----------------------------------------------------------------------------------------------

def _int_arg(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def _positive(name: str, value: Any, *, zero_ok: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name}: expected a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return float(value)


def paged_logits_flops(B: int, L: int, next_n: int, H: int, D: int) -> int:
    """Useful FLOPs of the paged indexer logits at the bench's inputs.

    The bench gives every request ``context_lens[b] = L`` (1-D form); query row ``j`` of ``next_n`` is
    the token at position ``L - next_n + j`` and sees keys ``t < L - next_n + j + 1`` (the contract of
    ``fp8_paged_mqa_logits``, ``nsa_backend.reference._paged_visible_lengths``). Each visible
    (row, key) pair costs ``2 * H * D`` FLOPs (the ``H`` dot products of length ``D``; the weighted sum
    over heads and the scale are not counted).

    Parameters
    ----------
    B : int
        Requests (>= 0).
    L : int
        Context length of every request (>= 0).
    next_n : int
        Query rows per request (>= 1).
    H, D : int
        Indexer heads and head dimension (>= 1).

    Returns
    -------
    int
        ``2 * H * D * B * sum_j max(0, L - next_n + j + 1)``; for ``L >= next_n`` that is
        ``2 * H * D * B * (next_n * L - next_n * (next_n - 1) / 2)``.
    """
    B, L = _int_arg("B", B, 0), _int_arg("L", L, 0)
    next_n, H, D = _int_arg("next_n", next_n, 1), _int_arg("H", H, 1), _int_arg("D", D, 1)
    pairs = sum(max(0, L - next_n + j + 1) for j in range(next_n))
    return 2 * H * D * B * pairs


def of_roofline(ratios: Mapping[str, float | None]) -> float | None:
    """The row's share of the roofline: ``max(of_copy, compute fraction)``.

    With ``of_copy = (bytes / ms) / copy`` and the compute fraction ``(flops / ms) / peak`` this is
    ``max(bytes / copy, flops / peak) / ms``: the time a kernel at the measured limits would need,
    over the row's time (1 = at the limits; above 1 only for rows faster than the op's ideal, e.g. a
    pure read timed against the op's FLOPs).

    Parameters
    ----------
    ratios : mapping
        The row's ratios; ``of_copy`` and one of ``of_fp8_mm`` / ``of_bf16_mm`` are read.

    Returns
    -------
    float or None
        None when the memory or the compute side is missing, and when both compute ratios are there:
        the op's compute limit is then unknown (the runner gives rows of ops outside its ``OP_LIMITS``
        a ratio against every limit).
    """
    mem = ratios.get(MEMORY_RATIO)
    comp = [v for v in (ratios.get(name) for name in COMPUTE_RATIOS.values()) if v is not None]
    if mem is None or len(comp) != 1:
        return None
    return max(mem, comp[0])


def ceiling_of_copy(flops: float, nbytes: float, copy_gbps: float, peak_tflops: float) -> float:
    """The highest ``of_copy`` the limits allow an op of ``flops`` FLOPs moving ``nbytes`` bytes.

    A kernel at the limits takes ``t = max(t_mem, t_comp)`` with ``t_mem = nbytes / copy`` and
    ``t_comp = flops / peak``; its ``of_copy`` is ``(nbytes / t) / copy = t_mem / t =
    min(1, t_mem / t_comp)`` (1 for an op without FLOPs).

    Parameters
    ----------
    flops : float
        Useful FLOPs of one call (>= 0).
    nbytes : float
        Bytes one call must move, as counted for its GB/s (> 0).
    copy_gbps : float
        Copy bandwidth, 10^9 B/s (> 0).
    peak_tflops : float
        Matmul rate the op's arithmetic runs at, 10^12 FLOP/s (> 0).

    Returns
    -------
    float
        In ``(0, 1]``.
    """
    flops = _positive("flops", flops, zero_ok=True)
    nbytes = _positive("nbytes", nbytes)
    copy_gbps, peak_tflops = _positive("copy_gbps", copy_gbps), _positive("peak_tflops", peak_tflops)
    t_mem = nbytes / (copy_gbps * 1e9)
    t_comp = flops / (peak_tflops * 1e12)
    return 1.0 if t_comp <= t_mem else t_mem / t_comp


# ----------------------------------------------------------------------------------------------
# A results file
# ----------------------------------------------------------------------------------------------

def load_results(src: str | Path) -> tuple[dict[str, Any], Path]:
    """The validated result of ``src`` (a results.json or its directory) and the file's path.

    Raises ``ValueError`` (one line naming ``RESULTS``) when the file is missing, is not JSON or does
    not follow :data:`nsa_backend.bench.schema.SCHEMA`.
    """
    path = Path(src)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ValueError(f"RESULTS: expected a results.json file or a directory holding one, got {str(src)!r} "
                         f"({str(path)!r} does not exist)")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"RESULTS: expected JSON in {str(path)!r}, got a parse error at line {exc.lineno} "
                         f"column {exc.colno}: {exc.msg}") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ValueError(f"RESULTS: expected a readable JSON text file, got {str(path)!r} "
                         f"({type(exc).__name__})") from None
    try:
        validate(result)
    except ValueError as exc:
        msg = " ".join(str(exc).split())
        raise ValueError(f"RESULTS: expected a results.json following nsa_backend.bench.schema, "
                         f"{str(path)!r} does not: {msg}") from None
    return result, path


def family_limits(result: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per family, the limits its rows were compared with.

    A limit is read back from the family's rows as rate / ratio (``gbps / of_copy``, ``tflops /
    of_fp8_mm``, ...) when every such row agrees; otherwise, or without such rows, the file's
    ``limits`` stand. A file merged from several runs (each family's note names its run) thus keeps
    each family with its own run's limits.
    """
    top = dict(result["limits"])
    seen: dict[str, dict[str, list[float]]] = {}
    for row in result["rows"]:
        values = seen.setdefault(row["family"], {})
        for key, (rate_key, ratio_name) in _RATE_OF_LIMIT.items():
            rate, ratio = row.get(rate_key), (row.get("ratios") or {}).get(ratio_name)
            if rate and ratio:
                values.setdefault(key, []).append(rate / ratio)
    out: dict[str, dict[str, float | None]] = {}
    for family, values in seen.items():
        limits = dict(top)
        for key, found in values.items():
            if max(found) - min(found) <= _SAME_LIMIT_RTOL * max(found):
                limits[key] = found[0]
        out[family] = limits
    return out


# Floor rows: the op's reads (and writes) alone, no arithmetic, so no FLOPs are counted for them.
FLOOR_IMPLS: tuple[str, ...] = ("read_kv", "read_kv_logits", "gather_kv", "read_a")


def _is_floor(impl: str) -> bool:
    return impl.removesuffix("-graph") in FLOOR_IMPLS


def _shape_flops(op: str, impl: str, shape: Any) -> int | None:
    if op not in PAGED_LOGITS_OPS or _is_floor(impl) or not isinstance(shape, dict):
        return None
    dims = [shape.get(k) for k in ("B", "context", "next_n", "H", "D")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in dims):
        return None
    try:
        return paged_logits_flops(*dims)
    except ValueError:
        return None


def roofline_rows(result: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[tuple[str, str], int]]:
    """The table's rows, and per (family, op) the number of rows left out (no time, or no rate).

    Each row: ``family``, ``op``, ``shape``, ``impl``, ``ms``, ``of_copy``, ``compute`` (the compute
    ratio's name), ``of_compute``, ``of_roofline``, ``binds`` (the limit that binds a kernel at the
    limits: ``copy`` or the matmul's), ``ceiling_of_copy`` and ``flops_from_shape``.
    """
    limits = family_limits(result)
    rows: list[dict[str, Any]] = []
    left_out: dict[tuple[str, str], int] = {}
    for row in result["rows"]:
        op = row["op"]
        if op not in ROOFLINE_OPS:
            continue
        key = (row["family"], op)
        lim = limits[row["family"]]
        peak_key = ROOFLINE_OPS[op]
        copy, peak = lim["copy_gbps"], lim[peak_key]
        ms, gbps, tflops = row["ms"], row["gbps"], row["tflops"]
        from_shape = False
        if ms and tflops is None:
            flops = _shape_flops(op, row["impl"], row["shape"])
            if flops is not None:
                tflops, from_shape = flops / ms / 1e9, True
        if not ms or (gbps is None and tflops is None):  # eager host times, skipped or failed rows
            left_out[key] = left_out.get(key, 0) + 1
            continue
        compute = COMPUTE_RATIOS[peak_key]
        ratios = {MEMORY_RATIO: gbps / copy if (gbps is not None and copy) else None,
                  compute: tflops / peak if (tflops is not None and peak) else None}
        ceiling = binds = None
        if gbps and tflops is not None and copy and peak:
            nbytes, flops = gbps * ms * 1e6, tflops * ms * 1e9
            ceiling = ceiling_of_copy(flops, nbytes, copy, peak)
            # of_copy / of_compute = (bytes / copy) / (flops / peak): the larger side binds at the limits
            binds = _LIMIT_LABEL["copy_gbps"] if ratios[MEMORY_RATIO] >= ratios[compute] else _LIMIT_LABEL[peak_key]
        rows.append({"family": row["family"], "op": op, "shape": row["shape"], "impl": row["impl"], "ms": ms,
                     "of_copy": ratios[MEMORY_RATIO], "compute": compute, "of_compute": ratios[compute],
                     "of_roofline": of_roofline(ratios), "binds": binds, "ceiling_of_copy": ceiling,
                     "flops_from_shape": from_shape})
    return rows, left_out


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isclose(a, b, rel_tol=_SAME_LIMIT_RTOL))


def _rows_text(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _shape_label(shape: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items()) if isinstance(shape, dict) else str(shape)


def _limits_text(limits: Mapping[str, float | None], keys: Sequence[str]) -> str:
    units = {"copy_gbps": "GB/s", "bf16_tflops": "TFLOP/s", "fp8_tflops": "TFLOP/s"}
    return ", ".join(f"{_LIMIT_LABEL[k]} "
                     + ("not measured" if limits.get(k) is None else f"{limits[k]:.4g} {units[k]}") for k in keys)


def roofline_markdown(result: Mapping[str, Any], source: str, command: str) -> str:
    """The markdown document: header (source, limits, command, definitions), one table per (family, op)."""
    rows, left_out = roofline_rows(result)
    limits = family_limits(result)
    all_keys = ("copy_gbps", "bf16_tflops", "fp8_tflops")
    lines = [
        "# Roofline share of the rows bounded by memory and compute",
        "",
        f"Source: `{source}` (created {result['created']}; its command: `{result['command']}`).",
        f"The file's limits (`limits`, measured by its run): {_limits_text(result['limits'], all_keys)}.",
        "",
        f"Command: `{command}`",
        "",
        "Columns: `of_copy` = GB/s / copy rate; `of_fp8_mm` / `of_bf16_mm` = useful TFLOP/s / that matmul "
        "rate; `of_roofline` = max of the two = max(bytes / copy, FLOPs / peak) / ms, the row's time as a "
        "share of the time a kernel at the limits would need (above 100% only for a row faster than that, "
        "e.g. a pure read); `binds` = the limit that binds such a kernel; `ceiling_of_copy` = min(1, "
        "(bytes / copy) / (FLOPs / peak)), the highest `of_copy` the limits allow the op. Ratios are against "
        "the limits of the run that measured the family (read back from its rows as rate / ratio).",
    ]
    sections: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        sections.setdefault((r["family"], r["op"]), []).append(r)
    if not sections:
        lines += ["", f"No timed rows of {', '.join(ROOFLINE_OPS)} in this file."]
    for (family, op), sec in sections.items():
        lim = limits.get(family, result["limits"])
        keys = ("copy_gbps", ROOFLINE_OPS[op])
        own = [k for k in keys if not _same(lim.get(k), result["limits"].get(k))]
        lines += ["", f"## {family}: {op}", "",
                  f"Limits: {_limits_text(lim, keys)}"
                  + (" (the family's own run, read back from its rows)." if own else " (the file's limits).")]
        derived = sum(r["flops_from_shape"] for r in sec)
        if derived:
            lines.append(f"FLOPs counted from the shape for {derived} rows that carry none: "
                         "2 * H * D * B * (visible (row, key) pairs), row j of next_n seeing keys "
                         "t < context - next_n + j + 1.")
        if left_out.get((family, op)):
            lines.append(f"Left out: {_rows_text(left_out[(family, op)])} without a time or a rate (skipped or "
                         "failed rows).")
        compute = COMPUTE_RATIOS[ROOFLINE_OPS[op]]
        lines += ["", f"| op | shape | impl | ms | of_copy | {compute} | of_roofline | binds | ceiling_of_copy |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sec:
            cells = [op, _shape_label(r["shape"]), r["impl"], f"{r['ms']:.4g}", _pct(r["of_copy"]),
                     _pct(r["of_compute"]), _pct(r["of_roofline"]), r["binds"] or "", _pct(r["ceiling_of_copy"])]
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    untimed = [f"{family} {op} ({_rows_text(n)})" for (family, op), n in left_out.items()
               if (family, op) not in sections]
    if untimed:
        lines += ["", "Families with no time or rate for these ops (e.g. the eager family's host times), left out: "
                  + ", ".join(untimed) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nsa_backend.bench.roofline RESULTS [--out FILE]``; returns the exit status.

    0 on success; 2 with one line on stderr when ``RESULTS`` is missing, not JSON or not a valid
    results file, or ``FILE`` cannot be written (argparse's usage errors also exit 2).
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=PROG, description="Roofline share of the rows of a results.json whose op is bounded by both "
                               "memory and compute (paged indexer logits, sparse MLA decode).")
    parser.add_argument("results", metavar="RESULTS", help="a results.json file or the directory holding one")
    parser.add_argument("--out", metavar="FILE", help="write the markdown table here (default: stdout)")
    args = parser.parse_args(args_in)
    try:
        result, path = load_results(args.results)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    text = roofline_markdown(result, str(path), shlex.join([*PROG.split(), *args_in]))
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as exc:
        print(f"{PROG}: --out: expected a writable file path, got {args.out!r} ({exc.strerror or exc})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
