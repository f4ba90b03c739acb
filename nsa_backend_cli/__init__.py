"""``nsa-backend``: inspect the installation, plan a model's routes, run a small DSA layer.

    nsa-backend doctor                      GPU, arch, versions, native packages, route of every op
    nsa-backend plan --model glm-5 --arch sm120 --kv-cache-dtype fp8_e4m3 --tp 4
    nsa-backend demo [--device cuda] [--steps 3]
    nsa-backend bench [--ops ...] [--quick] [--out DIR]   kernels vs native kernels and GPU limits
    nsa-backend --version

A bad input (flag, config file, environment variable) ends the command with one line on stderr,
``error: <what>: <why>``, and status 2; ``plan`` exits with status 1 and the validation message
when the prefill/decode choice cannot run for the model, arch, KV-cache dtype and heads per GPU.

This package is the console script's launcher. It sits outside ``nsa_backend`` because importing
anything inside that package runs its ``__init__``, which imports torch and registers the custom
ops. Here the parser is built from plain constants with the standard library only, and the command
modules (``nsa_backend._cli_commands``, ``nsa_backend._cli_demo``) are imported once a subcommand
runs, so ``--help`` and ``--version`` never import torch. ``python -m nsa_backend.cli`` runs the
same :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from nsa_backend_cli.bench import add_bench_parser
from nsa_backend_cli.errors import EXIT_USAGE, CliError, Parser

# nsa_backend.routing.device.ARCH_FAMILIES, spelled out so the parser imports no torch (a test keeps them equal)
ARCH_FAMILIES: tuple[str, ...] = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121", "rocm", "cpu")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "bf16", "fp8_e4m3", "fp8")
# subcommand -> "module:function" run with the parsed arguments (imported only when it runs)
COMMANDS: dict[str, str] = {
    "doctor": "nsa_backend._cli_commands:cmd_doctor",
    "plan": "nsa_backend._cli_commands:cmd_plan",
    "demo": "nsa_backend._cli_demo:cmd_demo",
    "bench": "nsa_backend._cli_commands:cmd_bench",
}

__all__ = ["ARCH_FAMILIES", "COMMANDS", "KV_CACHE_DTYPES", "build_parser", "main", "version"]


def version() -> str:
    """Installed version of the ``nsa-backend`` distribution."""
    try:
        return importlib.metadata.version("nsa-backend")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def build_parser() -> argparse.ArgumentParser:
    """The ``nsa-backend`` parser (standard library only); its errors raise :class:`CliError`."""
    parser = Parser(prog="nsa-backend", description="DeepSeek sparse attention kernels: installation check, "
                                                    "per-model route plans, a demo layer and benchmarks.")
    parser.add_argument("--version", action="version", version=f"nsa-backend {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,plan,demo,bench}")

    doctor = sub.add_parser("doctor", help="GPU, arch, versions, native packages, the route of every op, problems")
    doctor.add_argument("--config", help="TOML config file (default: $NSA_BACKEND_CONFIG)")
    doctor.add_argument("--model", default="deepseek-v3.2",
                        help="model whose shapes the route table uses (default: deepseek-v3.2)")
    doctor.add_argument("--tp", type=int, default=1, help="tensor-parallel degree for the route table")

    plan = sub.add_parser("plan", help="per-op route table of a model; exit 1 if the impl choice is invalid")
    plan.add_argument("--model", required=True,
                      help="HF config.json (file or directory) or a shipped name: deepseek-v3.2, glm-5, deepseek-v4")
    plan.add_argument("--arch", choices=ARCH_FAMILIES, help="arch family to plan for (default: this machine)")
    plan.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                      help="KV-cache dtype (auto: fp8_e4m3 on Blackwell, else bfloat16, as SGLang)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (attention heads per GPU)")
    plan.add_argument("--prefill-impl", default="auto", metavar="NAME",
                      help="auto, triton, reference or an SGLang --dsa-prefill-backend name (docs/config.md)")
    plan.add_argument("--decode-impl", default="auto", metavar="NAME",
                      help="auto, triton, reference or an SGLang --dsa-decode-backend name (docs/config.md)")
    plan.add_argument("--next-n", type=int, default=1, help="query tokens per request in decode: 1, or 2-4 with MTP")
    plan.add_argument("--config", help="TOML config file (default: $NSA_BACKEND_CONFIG)")
    plan.add_argument("--assume-natives", metavar="PKG[=VER],...",
                      help="plan as if these native packages were importable, e.g. deep_gemm=2.6.1,flash_mla")

    demo = sub.add_parser("demo", help="run one DSA attention layer (prefill + decode) through the routed ops "
                                       "and compare every op with the reference")
    demo.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available; on cpu the Triton "
                                       "kernels run in the Triton interpreter)")
    demo.add_argument("--tokens", type=int, default=96, help="prefill length (default: 96)")
    demo.add_argument("--steps", type=int, default=3, help="decode steps (default: 3)")
    demo.add_argument("--heads", type=int, default=16, help="attention heads, 1-128 (default: 16)")
    demo.add_argument("--topk", type=int, default=64, help="indexer top-k, at most --tokens (default: 64)")
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nsa-backend``; returns the exit status (a parse error exits with status 2)."""
    try:
        args = build_parser().parse_args(argv)
        module, func = COMMANDS[args.command].split(":")
        return int(getattr(importlib.import_module(module), func)(args))
    except CliError as exc:
        print(exc.line(), file=sys.stderr)
        return exc.status if exc.status else EXIT_USAGE
