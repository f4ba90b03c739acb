"""``nsa-backend``: inspect the installation, plan a model's routes, run a small DSA layer.

    nsa-backend doctor                      GPU, arch, versions, native packages, route of every op
    nsa-backend plan --model glm-5 --arch sm120 --kv-cache-dtype fp8_e4m3 --tp 4
    nsa-backend demo [--device cuda] [--steps 3]
    nsa-backend bench [--ops ...] [--quick] [--out DIR]   kernels vs native kernels and GPU limits

``plan`` exits with status 1 and the validation message when the prefill/decode choice cannot run
for the model, arch and KV-cache dtype; usage and config errors exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nsa_backend.bench.cli import add_bench_parser
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing.config import FAMILY_ENV, ConfigError, get_config, use_config
from nsa_backend.routing.device import ARCH_FAMILIES, detect_arch, device_summary, model_info
from nsa_backend.routing.router import OP_FAMILY, TENSOR_OPS, Decision, plan_routes
from nsa_backend.routing.validate import IMPL_CHOICES, ImplChoiceError, normalize_kv_dtype, validate_impl_choice

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


def _console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, soft_wrap=False, width=160)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    out = _console()
    problems: list[str] = []
    try:
        cfg = use_config(args.config) if args.config else get_config()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_USAGE

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
        problems.append("no CUDA GPU: every op runs the plain PyTorch reference (correct but slow)")
    info.add_row("arch family", arch + (f" (forced by {cfg.force_arch_source})" if cfg.force_arch else ""))
    info.add_row("python", sys.version.split()[0])
    info.add_row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or '-'}"
                          f"{', HIP ' + torch.version.hip if torch.version.hip else ''})")
    triton_version = _version("triton")
    info.add_row("triton", triton_version)
    if triton_version == "not installed" and gpu:
        problems.append("triton is not installed: GPU ops fall back to the PyTorch reference")
    info.add_row("nsa-backend", _version("nsa-backend"))
    info.add_row("config file", escape(cfg.path or "none (NSA_BACKEND_CONFIG unset)"))
    env = ", ".join(f"{FAMILY_ENV[k]}={v}" for k, v in cfg.env.items()) or "none"
    info.add_row("env overrides", env)
    out.print(info)

    natives = caps.probe_natives()
    nt = Table(title="native packages", title_justify="left")
    nt.add_column("package")
    nt.add_column("status")
    nt.add_column("version")
    nt.add_column("detail")
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

    from nsa_backend.models import load_model_config

    model = model_info(load_model_config(args.model))
    kv = normalize_kv_dtype("auto", arch) if arch != "cpu" else "bfloat16"
    decisions = plan_routes(model, arch, kv_cache_dtype=kv, tp=args.tp, config=cfg)
    out.print(_route_table(f"routes on {arch} for {model.architecture} (tp={args.tp}, kv={kv})", decisions))
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
    out = _console()
    from nsa_backend.models import load_model_config

    try:
        cfg = use_config(args.config) if args.config else get_config()
        info = model_info(load_model_config(args.model))
        info.heads_per_rank(args.tp)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    arch = args.arch or detect_arch()
    kv = normalize_kv_dtype(args.kv_cache_dtype, arch)
    try:
        validate_impl_choice(info.architecture, arch, kv, args.prefill_impl, args.decode_impl)
    except ImplChoiceError as exc:
        print(f"invalid implementation choice: {exc}", file=sys.stderr)
        return EXIT_INVALID
    natives = None
    if args.assume_natives:
        try:
            natives = {name: caps.NativeStatus(name, True, ver) for name, ver in _assumed(args.assume_natives)}
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        natives = {**{n: caps.NativeStatus(n, False, None, "not installed") for n in caps.NATIVE_IMPLS}, **natives}
    decisions = plan_routes(info, arch, kv_cache_dtype=kv, tp=args.tp, prefill_impl=args.prefill_impl,
                            decode_impl=args.decode_impl, next_n=args.next_n, natives=natives, config=cfg)
    title = (f"{info.architecture} on {arch}: tp={args.tp} (heads/rank {info.heads_per_rank(args.tp)}), "
             f"kv_cache_dtype={kv}, prefill={args.prefill_impl}, decode={args.decode_impl}, next_n={args.next_n}")
    out.print(_route_table(title, decisions))
    return EXIT_OK


def _assumed(text: str) -> list[tuple[str, str | None]]:
    pairs = []
    for item in text.split(","):
        name, _, version = item.strip().partition("=")
        if name not in caps.NATIVE_IMPLS:
            raise ValueError(f"--assume-natives: unknown package {name!r}; accepted: {list(caps.NATIVE_IMPLS)}")
        pairs.append((name, version or None))
    return pairs


# ----------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------

def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's scale-free gap 1 - 2 sum(xy) / sum(x^2 + y^2) (0 = identical)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    return 0.0 if denom == 0 else 1.0 - 2.0 * (x * y).sum().item() / denom


def _topk_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of row-wise top-k sets (ignoring -1) that agree."""
    total, same = 0, 0
    for ra, rb in zip(a.tolist(), b.tolist()):
        sa, sb = {v for v in ra if v >= 0}, {v for v in rb if v >= 0}
        total += max(len(sa), 1)
        same += len(sa & sb) if sa else 1
    return same / total


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> _Timer:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ms = (time.perf_counter() - self.start) * 1e3


def run_demo(device: torch.device, *, prefill_tokens: int = 96, steps: int = 3, heads: int = 16,
             index_heads: int = 8, index_dim: int = 64, topk: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """One DSA attention layer with random weights: a prefill of ``prefill_tokens`` tokens and
    ``steps`` decode steps through the routed ops, each compared with ``impl="reference"``.

    Returns one record per op call: phase, op, impl, agreement, milliseconds (the first call of
    each op runs once untimed, so compilation is not counted).
    """
    import nsa_backend as nb
    from nsa_backend.routing.router import select_impl

    gen = torch.Generator().manual_seed(seed)
    d_qk, d_v, page = 576, 512, 64
    sm_scale = d_qk ** -0.5
    hidden = 256
    total = prefill_tokens + steps
    pages = math.ceil(total / page)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    # Random layer weights: hidden -> MLA latent (q and kv share the absorbed 576-dim space) and
    # hidden -> indexer q / k / head weights.
    w_q = randn(hidden, heads * d_qk, scale=hidden ** -0.5)
    w_kv = randn(hidden, d_qk, scale=hidden ** -0.5)
    w_iq = randn(hidden, index_heads * index_dim, scale=hidden ** -0.5)
    w_ik = randn(hidden, index_dim, scale=hidden ** -0.5)
    w_iw = randn(hidden, index_heads, scale=hidden ** -0.5)
    x = randn(total, hidden)

    def quant_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = t.abs().amax(-1).clamp(min=1e-4) / 448.0
        return (t / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()

    records: list[dict[str, Any]] = []

    warmed: set[str] = set()

    def call(phase: str, op: str, features: dict[str, Any], fn, compare) -> Any:
        impl = select_impl(op, "auto", {"device": device, **features})
        if op not in warmed:  # first call: kernel compilation and op registration, not timed
            fn("auto")
            warmed.add(op)
        with _Timer(device) as timer:
            result = fn("auto")
        ref = fn("reference")
        records.append({"phase": phase, "op": op, "impl": impl, "agreement": compare(result, ref),
                        "ms": timer.ms})
        return result

    diff = lambda a, b: f"diff {_calc_diff(a, b):.2e}"
    exact = lambda a, b: "exact" if torch.equal(a, b) else f"max |d| {(a.float() - b.float()).abs().max():.2e}"
    logits_gap = lambda a, b: diff(torch.nan_to_num(a, neginf=0.0), torch.nan_to_num(b, neginf=0.0))

    # ---- prefill --------------------------------------------------------------------------
    s = prefill_tokens
    xs = x[:s]
    q_idx, q_idx_scale = quant_rows((xs @ w_iq).view(s, index_heads, index_dim))
    k_idx, k_idx_scale = quant_rows(xs @ w_ik)
    weights = ((xs @ w_iw) * q_idx_scale.amax(-1, keepdim=True) * (index_heads * index_dim) ** -0.5).float()
    ks = torch.zeros(s, dtype=torch.int32, device=device)
    ke = torch.arange(1, s + 1, dtype=torch.int32, device=device)
    feats = {"num_heads": index_heads, "head_dim": index_dim, "compressed": False}
    logits = call("prefill", "fp8_mqa_logits", feats,
                  lambda impl: nb.fp8_mqa_logits(q_idx, (k_idx, k_idx_scale), weights, ks, ke, impl=impl), logits_gap)
    idx = call("prefill", "topk_indices", {"topk": topk, "n": s},
               lambda impl: nb.topk_indices(logits, topk, ks, ke, impl=impl),
               lambda a, b: f"top-k overlap {_topk_overlap(a, b):.3f}")
    q = (xs @ w_q).view(s, heads, d_qk).to(torch.bfloat16)
    kv = (xs @ w_kv).to(torch.bfloat16)
    call("prefill", "flash_mla_sparse_fwd", {"num_heads": heads, "d_qk": d_qk, "topk": topk},
         lambda impl: nb.flash_mla_sparse_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), sm_scale, d_v, impl=impl)[0],
         diff)
    mla_cache = torch.zeros(pages, page, 656, dtype=torch.uint8, device=device)
    slots = torch.arange(s, dtype=torch.int64, device=device)

    def write(impl: str) -> torch.Tensor:
        cache = mla_cache.clone()
        nb.write_fp8_ds_mla_cache(kv, cache, slots, impl=impl)
        return cache

    mla_cache = call("prefill", "write_fp8_ds_mla_cache", {}, write, exact)

    # ---- decode ---------------------------------------------------------------------------
    block_table = torch.arange(pages, dtype=torch.int32, device=device).view(1, pages)
    indexer_keys = [k_idx, k_idx_scale]
    # DeepGEMM's schedule must be built for the device's SM count.
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4

    def decode_step(step: int, mla_cache: torch.Tensor) -> torch.Tensor:
        t = s + step
        xt = x[t:t + 1]
        phase = f"decode {step + 1}"
        k_new, k_new_scale = quant_rows(xt @ w_ik)
        indexer_keys[0] = torch.cat([indexer_keys[0], k_new])
        indexer_keys[1] = torch.cat([indexer_keys[1], k_new_scale])
        idx_cache = nb.pack_indexer_k_cache((indexer_keys[0], indexer_keys[1]), page)
        idx_cache = torch.cat([idx_cache, idx_cache.new_zeros(pages - idx_cache.shape[0], *idx_cache.shape[1:])])
        kv_t = (xt @ w_kv).to(torch.bfloat16)
        mla_cache = call(phase, "write_fp8_ds_mla_cache", {},
                         lambda impl: _write_into(nb, kv_t, mla_cache, t, impl), exact)
        ctx = torch.tensor([t + 1], dtype=torch.int32, device=device)
        meta = call(phase, "get_paged_mqa_logits_metadata", {"page_size": page},
                    lambda impl: nb.get_paged_mqa_logits_metadata(ctx, page, num_sms, impl=impl), lambda a, b: "-")
        qi, qi_scale = quant_rows((xt @ w_iq).view(1, 1, index_heads, index_dim))
        wi = ((xt @ w_iw) * qi_scale.view(1, -1).amax(-1, keepdim=True) * (index_heads * index_dim) ** -0.5).float()
        feats = {"num_heads": index_heads, "head_dim": index_dim, "next_n": 1, "page_size": page,
                 "context_lens_2d": False}
        dl = call(phase, "fp8_paged_mqa_logits", feats,
                  lambda impl: nb.fp8_paged_mqa_logits(qi, idx_cache, wi, ctx, block_table, meta, t + 1,
                                                       clean_logits=True, impl=impl), logits_gap)
        logical = call(phase, "topk_indices", {"topk": topk, "n": t + 1},
                       lambda impl: nb.topk_indices(dl, topk, impl=impl),
                       lambda a, b: f"top-k overlap {_topk_overlap(a, b):.3f}")
        req = torch.zeros(1, dtype=torch.int32, device=device)
        glob = call(phase, "logical_to_global_indices", {"page_size": page},
                    lambda impl: nb.logical_to_global_indices(logical, block_table, req, page, impl=impl), exact)
        qd = (xt @ w_q).view(1, 1, heads, d_qk).to(torch.bfloat16)
        call(phase, "sparse_mla_decode", {"num_heads": heads, "d_qk": d_qk, "topk": topk, "s_q": 1,
                                          "kv_format": "fp8_ds_mla", "page_size": page},
             lambda impl: nb.sparse_mla_decode(qd, mla_cache, glob.view(1, 1, topk), sm_scale, d_v,
                                               "fp8_ds_mla", impl=impl)[0], diff)
        return mla_cache

    for step in range(steps):
        mla_cache = decode_step(step, mla_cache)
    return records


def _write_into(nb: Any, kv_t: torch.Tensor, cache: torch.Tensor, slot: int, impl: str) -> torch.Tensor:
    out = cache.clone()
    nb.write_fp8_ds_mla_cache(kv_t, out, torch.tensor([slot], dtype=torch.int64, device=cache.device), impl=impl)
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    out = _console()
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return EXIT_USAGE
    try:
        get_config()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    start = time.perf_counter()
    records = run_demo(device, prefill_tokens=args.tokens, steps=args.steps, heads=args.heads, topk=args.topk)
    wall = time.perf_counter() - start
    table = Table(title=f"DSA layer demo on {device} ({detect_arch(device)}): prefill {args.tokens} tokens, "
                        f"{args.steps} decode steps, {args.heads} heads, top-k {args.topk}", title_justify="left")
    for col in ("phase", "op", "impl", "agreement with reference", "ms"):
        table.add_column(col, justify="right" if col == "ms" else "left")
    for r in records:
        table.add_row(r["phase"], r["op"], r["impl"], r["agreement"], f"{r['ms']:.2f}")
    out.print(table)
    out.print(f"total wall time {wall:.2f} s (routed calls plus reference checks)")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nsa-backend", description="DeepSeek sparse attention kernels: "
                                     "installation check, per-model route plans and a demo layer.")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="GPU, arch, versions, native packages, the route of every op, problems")
    doctor.add_argument("--config", help="TOML config file (default: $NSA_BACKEND_CONFIG)")
    doctor.add_argument("--model", default="deepseek-v3.2",
                        help="model whose shapes the route table uses (default: deepseek-v3.2)")
    doctor.add_argument("--tp", type=int, default=1, help="tensor-parallel degree for the route table")
    doctor.set_defaults(func=cmd_doctor)

    plan = sub.add_parser("plan", help="per-op route table of a model; exit 1 if the impl choice is invalid")
    plan.add_argument("--model", required=True,
                      help="HF config.json (file or directory) or a shipped name: deepseek-v3.2, glm-5, deepseek-v4")
    plan.add_argument("--arch", choices=ARCH_FAMILIES, help="arch family to plan for (default: this machine)")
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "bf16", "fp8_e4m3", "fp8"],
                      help="KV-cache dtype (auto: fp8_e4m3 on Blackwell, else bfloat16, as SGLang)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (attention heads per GPU)")
    plan.add_argument("--prefill-impl", default="auto", choices=IMPL_CHOICES)
    plan.add_argument("--decode-impl", default="auto", choices=IMPL_CHOICES)
    plan.add_argument("--next-n", type=int, default=1, help="query tokens per request in decode (MTP: 2-4)")
    plan.add_argument("--config", help="TOML config file (default: $NSA_BACKEND_CONFIG)")
    plan.add_argument("--assume-natives", metavar="PKG[=VER],...",
                      help="plan as if these native packages were importable, e.g. deep_gemm=2.6.1,flash_mla")
    plan.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="run one DSA attention layer (prefill + decode) through the routed ops")
    demo.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--tokens", type=int, default=96, help="prefill length")
    demo.add_argument("--steps", type=int, default=3, help="decode steps")
    demo.add_argument("--heads", type=int, default=16, help="attention heads")
    demo.add_argument("--topk", type=int, default=64, help="indexer top-k")
    demo.set_defaults(func=cmd_demo)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
