"""Arguments of ``nsa-backend bench`` (and of ``python -m nsa_backend.bench``), without importing
``nsa_backend``: the suite itself is :mod:`nsa_backend.bench`, run by ``nsa_backend.bench.cli.run_bench``.
"""

from __future__ import annotations

import argparse

# nsa_backend.bench.FAMILIES, spelled out so the parser imports no torch (a test keeps them equal)
FAMILIES: tuple[str, ...] = ("indexer", "topk", "sparse_mla", "mhc", "v4", "eager", "peers")
# nsa_backend.bench.proxy.PROXY_ARCHS, likewise spelled out
PROXY_ARCHS: tuple[str, ...] = ("sm80", "sm86", "sm89", "sm120", "sm121")

DESCRIPTION = (
    "Time every op family on its standard shapes against the torch fallback, the native kernels that are "
    "importable (flash_mla, deep_gemm, flashinfer) and the copy / bf16 / fp8 matmul rates measured in the "
    "same process. Writes results.json, results.md, results.csv and one PNG per family."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of the benchmark command to ``parser``."""
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
    parser.add_argument("--proxy", metavar="ARCH", default=None, choices=PROXY_ARCHS,
                        help="on an sm_90 / sm_100 GPU, time the route of this mma.sync arch "
                             f"({', '.join(PROXY_ARCHS)}): its launch configurations and shared-memory budget, "
                             "Triton's Hopper MMA disabled (DISABLE_MMA_V3=1), natives off and only the Gluon "
                             "kernels written for that arch routed, limits "
                             "from a Triton matmul under the same restriction, and a SASS check (sass.md); "
                             "default output bench/results/<gpu>-proxy-<arch>")
    parser.add_argument("--replot", metavar="PATH", default=None,
                        help="measure nothing: rewrite results.md, results.csv and the plots from PATH "
                             "(a results.json or its directory), into --out if given")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``nsa-backend`` parser and return it."""
    parser = subparsers.add_parser("bench", help="benchmark the kernels against native kernels and GPU limits",
                                   description=DESCRIPTION)
    add_arguments(parser)
    return parser
