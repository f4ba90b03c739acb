"""Command-line wiring of the benchmark suite.

The arguments are declared in :mod:`nsa_backend_cli.bench` (the ``nsa-backend`` launcher builds its
parser without importing this package); ``run_bench(args)`` runs the suite with them,
``add_bench_parser(subparsers)`` adds the subcommand with ``func=run_bench``, and ``main()`` serves
``python -m nsa_backend.bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from nsa_backend_cli import bench as bench_args


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (:func:`nsa_backend_cli.bench.add_bench_parser`); its namespace gets
    ``func=run_bench``."""
    parser = bench_args.add_bench_parser(subparsers)
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
                                    progress=args.progress, git_commit=args.git_commit,
                                    proxy_arch=args.proxy)
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
    sass = (result.get("proxy") or {}).get("sass")
    if sass is not None:
        style = "green" if sass["ok"] else "red"
        console.print(f"[{style}]proxy SASS check: {'held' if sass['ok'] else sass['problem']}[/{style}] "
                      f"({out_dir / 'sass.md'})")
        failed |= not sass["ok"]
    console.print(f"results: {out_dir / 'results.md'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m nsa_backend.bench``."""
    parser = argparse.ArgumentParser(prog="python -m nsa_backend.bench", description=bench_args.DESCRIPTION)
    bench_args.add_arguments(parser)
    return run_bench(parser.parse_args(sys.argv[1:] if argv is None else argv))
