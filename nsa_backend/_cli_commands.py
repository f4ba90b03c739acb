"""``nsa-backend doctor``, ``plan`` and the input checks of ``bench``.

Every input is checked before anything is printed: the config file and its ``[sglang]`` / ``[vllm]``
tables, the environment variables, the model, the tensor-parallel degree and, for ``plan``, the
arch, KV-cache dtype, implementation choices (with their heads-per-GPU limits), ``--next-n`` and
the assumed native packages. A bad one raises :class:`~nsa_backend._cli_errors.CliError`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nsa_backend._cli_errors import EXIT_INVALID, EXIT_OK, CliError, int_in_range, one_of
from nsa_backend.bench.cli import run_bench
from nsa_backend.bench.runner import select
from nsa_backend.indexer import MAX_NEXT_N
from nsa_backend.models import load_model_config
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing.config import CONFIG_ENV, FAMILY_ENV, Config, ConfigError, get_config, use_config
from nsa_backend.routing.device import DEEPSEEK_V4, ModelInfo, detect_arch, device_summary, model_info
from nsa_backend.routing.router import OP_FAMILY, TENSOR_OPS, Decision, plan_routes
from nsa_backend.routing.validate import IMPL_CHOICES, ImplChoiceError, normalize_kv_dtype, validate_impl_choice
from nsa_backend_integrations.sglang import settings as sglang_settings
from nsa_backend_integrations.vllm import config as vllm_settings

# Package versions such as 2.6.1, 0.7.2.post1, 0.2.3+cu129 (what importlib.metadata reports).
_VERSION = re.compile(r"v?\d+(\.\d+)*([.+-]?[A-Za-z0-9.+-]*)?")


def _console() -> Console:
    return Console(soft_wrap=False, width=160)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ----------------------------------------------------------------------------------------------
# Shared input checks
# ----------------------------------------------------------------------------------------------

def load_checked_config(path: str | None) -> Config:
    """The configuration of ``--config`` (else ``$NSA_BACKEND_CONFIG``) and the environment, with the
    ``[sglang]`` / ``[vllm]`` tables checked by the integrations' own settings readers (which import
    neither framework). Every failure is a :class:`CliError`."""
    try:
        cfg = use_config(path) if path else get_config()
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    try:
        sglang_settings.load_settings(cfg.path)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    try:
        vllm_settings.load_settings(cfg.path)
    except (ValueError, TypeError) as exc:
        env = [var for var in (vllm_settings.TAKEOVER_ENV, vllm_settings.INDEXER_ENV, vllm_settings.HC_PRENORM_ENV)
               if os.environ.get(var)]
        sources = ", ".join([*([cfg.path] if cfg.path else []), *env])
        raise CliError(f"[vllm] settings ({sources})", str(exc)) from None
    return cfg


def load_model(name: str, tp: int) -> tuple[ModelInfo, int]:
    """The model of ``--model`` and its attention heads per GPU under ``--tp``."""
    try:
        info = model_info(load_model_config(name))
    except (ValueError, OSError) as exc:
        raise CliError(f"--model {name}", str(exc)) from None
    if tp < 1 or info.num_heads % tp:
        divisors = [d for d in range(1, info.num_heads + 1) if info.num_heads % d == 0]
        raise CliError(f"--tp {tp}", f"must divide the {info.num_heads} attention heads of {info.architecture}; "
                                     f"accepted values: {', '.join(map(str, divisors))}")
    return info, info.num_heads // tp


def assumed_natives(text: str) -> dict[str, caps.NativeStatus]:
    """``--assume-natives NAME[=VERSION],...`` as probe results (every other package missing).

    A version is required for packages whose capability rows depend on it (DeepGEMM, FlashInfer), it
    must read as a version number, and it must not be below the oldest release any row accepts.
    """
    flag = "--assume-natives"
    out = {n: caps.NativeStatus(n, False, None, "not installed") for n in caps.NATIVE_IMPLS}
    seen: set[str] = set()
    for item in text.split(","):
        name, _, version = (part.strip() for part in item.strip().partition("="))
        if name not in caps.NATIVE_IMPLS:
            raise CliError(f"{flag} {item.strip() or repr(item)}", f"unknown package {name!r}; accepted packages: "
                                                                   f"{', '.join(caps.NATIVE_IMPLS)}")
        if name in seen:
            raise CliError(f"{flag} {name}", "named twice")
        seen.add(name)
        rows = [r for r in caps.TABLE if r.package == name]
        bounded = any(r.min_version or r.max_version for r in rows)
        if not version and bounded:
            raise CliError(f"{flag} {name}", f"needs a version ({name}=VERSION, e.g. {name}={_example(rows)}): "
                                             f"which {name} kernels route depends on it")
        if version and not _VERSION.fullmatch(version):
            raise CliError(f"{flag} {name}={version}", f"not a version number; expected e.g. {name}={_example(rows)}")
        mins = [r.min_version for r in rows]
        if version and mins and all(mins):
            lowest = min(mins, key=caps.parse_version)
            if caps.parse_version(version) < caps.parse_version(lowest):
                raise CliError(f"{flag} {name}={version}", f"nsa-backend uses {name} >= {lowest}")
        out[name] = caps.NativeStatus(name, True, version or None)
    return out


def _example(rows: Sequence[caps.Support]) -> str:
    versions = [v for r in rows for v in (r.min_version, r.max_version) if v]
    return max(versions, key=caps.parse_version) if versions else "1.0"


def _route_table(title: str, decisions: Sequence[Decision]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("op")
    table.add_column("family")
    table.add_column("impl", style="bold")
    table.add_column("chosen by")
    table.add_column("note")
    for d in decisions:
        pad = ", ".join(f"{k} padded to {v}" for k, v in d.padded.items())
        note = "; ".join(x for x in (d.reason, pad) if x)
        table.add_row(d.op, OP_FAMILY.get(d.op) or "-", d.impl, escape(d.source), escape(note))
    return table


# ----------------------------------------------------------------------------------------------
# doctor
# ----------------------------------------------------------------------------------------------

def cmd_doctor(args: argparse.Namespace) -> int:
    """Run ``nsa-backend doctor``."""
    cfg = load_checked_config(args.config)
    info_model, _ = load_model(args.model, args.tp)
    out = _console()
    problems: list[str] = []

    info = Table(title="nsa-backend doctor", title_justify="left", show_header=False)
    info.add_column("item", style="bold")
    info.add_column("value")
    gpu = device_summary()
    arch = detect_arch()
    if gpu:
        info.add_row("GPU", f"{gpu['name']} (compute capability {gpu['capability']}, {gpu['sm_count']} SMs, "
                            f"{gpu['memory_gib']} GiB)")
        major = int(gpu["capability"].split(".")[0])
        if major < 8 and torch.version.hip is None:
            problems.append(f"compute capability {gpu['capability']} is below 8.0; nsa-backend needs Ampere or newer")
        if cfg.force_arch and cfg.force_arch != gpu["family"]:
            problems.append(f"routing is forced to {cfg.force_arch} ({cfg.force_arch_source}) on a "
                            f"{gpu['family']} GPU")
    else:
        info.add_row("GPU", "none (CUDA not available)")
        problems.append("no CUDA GPU: every op runs the plain PyTorch reference (correct but slow; "
                        "`nsa-backend demo` runs the Triton kernels in the CPU interpreter)")
    info.add_row("arch family", arch + (f" (forced by {cfg.force_arch_source})" if cfg.force_arch else ""))
    info.add_row("python", sys.version.split()[0])
    info.add_row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or '-'}"
                          f"{', HIP ' + torch.version.hip if torch.version.hip else ''})")
    triton_version = _version("triton")
    info.add_row("triton", triton_version)
    if triton_version == "not installed" and gpu:
        problems.append("triton is not installed: GPU ops fall back to the PyTorch reference")
    info.add_row("nsa-backend", _version("nsa-backend"))
    info.add_row("config file", escape(cfg.path or f"none ({CONFIG_ENV} unset)"))
    env = ", ".join(f"{FAMILY_ENV[k]}={v}" for k, v in cfg.env.items()) or "none"
    info.add_row("env overrides", env)
    out.print(info)

    natives = caps.probe_natives()
    nt = Table(title="native packages", title_justify="left")
    for col in ("package", "status", "version", "detail"):
        nt.add_column(col)
    for name, status in natives.items():
        if status.available:
            api = f"upstream API {status.api_version}" if status.api_version else ""
            nt.add_row(name, "[green]importable[/green]", status.version or "?", api)
        else:
            nt.add_row(name, "missing" if status.version is None else "[red]broken[/red]", status.version or "-",
                       escape(status.error or ""))
            if status.version is not None:
                problems.append(f"{name} {status.version} is installed but does not import: {status.error}")
    out.print(nt)

    # DeepSeek-V4 keeps its FP8 cache on every arch (see cmd_plan)
    if info_model.family == DEEPSEEK_V4:
        kv = "fp8_e4m3"
    else:
        kv = normalize_kv_dtype("auto", arch) if arch != "cpu" else "bfloat16"
    decisions = plan_routes(info_model, arch, kv_cache_dtype=kv, tp=args.tp, config=cfg)
    out.print(_route_table(f"routes on {arch} for {info_model.architecture} (tp={args.tp}, kv={kv})", decisions))
    if arch != "cpu":
        for d in decisions:
            if d.impl == "reference" and d.op not in TENSOR_OPS:
                problems.append(f"{d.op} runs the PyTorch reference on the GPU ({d.reason})")
    if problems:
        out.print("[bold yellow]problems:[/bold yellow]")
        for p in problems:
            out.print(f"  - {p}", markup=False, highlight=False)
    else:
        out.print("[bold green]no problems found[/bold green]")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    """Run ``nsa-backend plan``; an implementation choice that cannot run is a status-1 error."""
    cfg = load_checked_config(args.config)
    info, heads = load_model(args.model, args.tp)
    arch = args.arch or detect_arch()
    prefill = one_of("--prefill-impl", args.prefill_impl, IMPL_CHOICES)
    decode = one_of("--decode-impl", args.decode_impl, IMPL_CHOICES)
    next_n = int_in_range("--next-n", args.next_n, 1, MAX_NEXT_N, "query tokens per request: 1, or 2-4 with MTP")
    natives = assumed_natives(args.assume_natives) if args.assume_natives is not None else None
    # DeepSeek-V4's cache is FP8 unless bf16 is asked for: vLLM maps --kv-cache-dtype auto to its fp8_ds_mla
    # layout and SGLang's dsv4 backend stores FP8 (the 584-byte format) on every arch.
    v4_auto = info.family == DEEPSEEK_V4 and args.kv_cache_dtype == "auto"
    kv = "fp8_e4m3" if v4_auto else normalize_kv_dtype(args.kv_cache_dtype, arch)
    try:
        validate_impl_choice(info.architecture, arch, kv, prefill, decode, heads_per_gpu=heads)
    except ImplChoiceError as exc:
        flags = " ".join(f"--{phase}-impl {name}" for phase, name in (("prefill", prefill), ("decode", decode))
                         if name != "auto")
        raise CliError(flags or "implementation choice", str(exc), EXIT_INVALID) from None
    decisions = plan_routes(info, arch, kv_cache_dtype=kv, tp=args.tp, prefill_impl=prefill, decode_impl=decode,
                            next_n=next_n, natives=natives, config=cfg)
    title = (f"{info.architecture} on {arch}: tp={args.tp} (heads/rank {heads}), kv_cache_dtype={kv}, "
             f"prefill={prefill}, decode={decode}, next_n={next_n}")
    _console().print(_route_table(title, decisions))
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------

def check_bench_args(args: argparse.Namespace) -> None:
    """Check ``bench``'s flags before any measurement: ``--ops`` names, ``--replot`` source, ``--out``."""
    names = [name for item in args.ops or () for name in item.split(",") if name]
    try:
        select(names or None)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.replot is not None:
        src = Path(args.replot)
        if not (src / "results.json" if src.is_dir() else src).is_file():
            raise CliError(f"--replot {args.replot}", "expected a results.json file or a directory holding one")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise CliError(f"--out {args.out}", "exists and is not a directory; expected an output directory")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``nsa-backend bench`` once its flags are checked (the suite reports failures of its own)."""
    check_bench_args(args)
    return run_bench(args)
