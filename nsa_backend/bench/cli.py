"""Command-line wiring of the benchmark suite.

``add_bench_parser(subparsers)`` adds the ``bench`` subcommand to the ``nsa-backend`` parser and
``run_bench(args)`` runs it; ``main()`` serves ``python -m nsa_backend.bench``. Heavy imports
(torch, the runner) happen inside ``run_bench`` so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from nsa_backend.bench import FAMILIES

DESCRIPTION = (
    "Time every op family on its standard shapes against the torch fallback, the native kernels that are "
    "importable (flash_mla, deep_gemm, flashinfer) and the copy / bf16 / fp8 matmul rates measured in the "
    "same process. Writes results.json, results.md, results.csv and one PNG per family."
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", nargs="+", metavar="NAME", default=None,
                        help=f"families ({', '.join(FAMILIES)}) and/or public op names, space- or "
                             "comma-separated (default: all families)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and short limit measurements (always on without a GPU: the "
                             "reference path on tiny shapes)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="output directory (default: bench/results/<gpu>, e.g. bench/results/h200)")
    parser.add_argument("--no-plots", dest="plots", action="store_false", help="do not write PNG plots")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--git-commit", metavar="SHA", default=None,
                        help="commit to record in results.json (default: asked from git)")
    parser.add_argument("--replot", metavar="PATH", default=None,
                        help="measure nothing: rewrite results.md, results.csv and the plots from PATH "
                             "(a results.json or its directory), into --out if given")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand; its namespace gets ``func=run_bench``."""
    parser = subparsers.add_parser("bench", help="benchmark the kernels against native kernels and GPU limits",
                                   description=DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run_bench)
    return parser


def _split_ops(ops: Sequence[str] | None) -> list[str] | None:
    if not ops:
        return None
    return [name for item in ops for name in item.split(",") if name]


def run_bench(args: argparse.Namespace) -> int:
    """Run ``nsa-backend bench`` with parsed arguments; 0 when every selected family ran, else 1."""
    from rich.console import Console

    from nsa_backend.bench.runner import replot, run_suite

    console = Console(stderr=True, soft_wrap=True)
    try:
        if args.replot:
            _, out_dir = replot(args.replot, args.out, plots=args.plots)
            console.print(f"results: {out_dir / 'results.md'}")
            return 0
        result, out_dir = run_suite(_split_ops(args.ops), quick=args.quick, out=args.out, plots=args.plots,
                                    progress=args.progress, git_commit=args.git_commit)
    except (ValueError, json.JSONDecodeError) as exc:
        console.print(f"[red]nsa-backend bench: {exc}[/red]")
        return 2
    failed = False
    for family, info in result["families"].items():
        style = {"ok": "green", "skipped": "yellow", "error": "red"}[info["status"]]
        note = f": {info['note']}" if info["note"] else ""
        if not args.progress or info["status"] == "error":
            console.print(f"[{style}]{family:<11} {info['status']:<8}[/{style}] {info['rows']:>3} rows, "
                          f"{info['seconds']:.1f} s{note}")
        failed |= info["status"] == "error"
    console.print(f"results: {out_dir / 'results.md'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m nsa_backend.bench``."""
    parser = argparse.ArgumentParser(prog="python -m nsa_backend.bench", description=DESCRIPTION)
    _add_arguments(parser)
    return run_bench(parser.parse_args(sys.argv[1:] if argv is None else argv))
