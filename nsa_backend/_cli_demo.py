"""``nsa-backend demo``: one DSA attention layer through the routed ops, checked against the reference.

On a GPU the ops take their automatic route. On a CPU the demo runs the Triton kernels in Triton's
interpreter (``TRITON_INTERPRET=1``, set by the command before any kernel module loads) when Triton
is installed, so the comparison checks real kernels; without Triton every row is the reference
itself, and the table says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import nsa_backend as nb
from nsa_backend import envs
from nsa_backend._cli_errors import EXIT_INVALID, EXIT_OK, CliError, int_in_range
from nsa_backend.routing.config import ConfigError, get_config
from nsa_backend.routing.device import detect_arch
from nsa_backend.routing.router import select_impl
from nsa_backend.sparse_mla import MAX_HEADS
from nsa_backend.topk import MAX_TOPK

# Agreement a routed op must reach with the reference: DeepGEMM's scale-free diff for float
# outputs (bf16 attention and fp32 logits differ by rounding and summation order, ~1e-6), the share
# of top-k sets that agree (near-equal logits may swap the last members), exact for index and
# cache-layout ops.
DIFF_TOLERANCE = 1e-3
OVERLAP_TOLERANCE = 0.9
MAX_TOKENS = 65536
MAX_STEPS = 1024
# Modules whose import fixes the Triton mode: TRITON_INTERPRET must be set before the first one loads.
_KERNEL_PREFIX = "nsa_backend.kernels"


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
    """Wall time of a block in milliseconds (``.ms``), synchronising a CUDA device on both ends."""

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
             index_heads: int = 8, index_dim: int = 64, topk: int = 64, seed: int = 0,
             requested: str = "auto") -> list[dict[str, Any]]:
    """One DSA attention layer with random weights: a prefill of ``prefill_tokens`` tokens and
    ``steps`` decode steps through the routed ops, each compared with ``impl="reference"``.

    ``requested`` is the ``impl`` every op is called with: ``"auto"`` (routing decides) or
    ``"triton"`` (on CPU tensors: the Triton kernels in the interpreter, ``TRITON_INTERPRET=1``).

    Returns one record per op call: phase, op, impl, agreement (text), ok (within tolerance; ``None``
    when the row ran the reference itself and there is nothing to compare), milliseconds (the first
    call of each op runs once untimed, so compilation is not counted).
    """
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

    def call(phase: str, op: str, features: dict[str, Any], fn: Callable[[str], Any],
             compare: Callable[[Any, Any], tuple[str, bool]]) -> Any:
        impl = select_impl(op, requested, {"device": device, **features})
        if op not in warmed:  # first call: kernel compilation and op registration, not timed
            fn(requested)
            warmed.add(op)
        with _Timer(device) as timer:
            result = fn(requested)
        if impl == "reference":
            text, ok = "- (this row is the reference itself: nothing compared)", None
        else:
            text, ok = compare(result, fn("reference"))
        records.append({"phase": phase, "op": op, "impl": impl, "agreement": text, "ok": ok, "ms": timer.ms})
        return result

    def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[str, bool]:
        gap = _calc_diff(a, b)
        return f"diff {gap:.2e} (tolerance {DIFF_TOLERANCE:.0e})", gap <= DIFF_TOLERANCE

    def exact(a: torch.Tensor, b: torch.Tensor) -> tuple[str, bool]:
        if torch.equal(a, b):
            return "exact", True
        return f"max |d| {(a.float() - b.float()).abs().max():.2e} (expected exact)", False

    def logits_gap(a: torch.Tensor, b: torch.Tensor) -> tuple[str, bool]:
        # -inf marks keys outside a query's window; both sides must agree on where they are
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            return "masked positions differ", False
        return diff(torch.nan_to_num(a, neginf=0.0), torch.nan_to_num(b, neginf=0.0))

    def overlap(a: torch.Tensor, b: torch.Tensor) -> tuple[str, bool]:
        share = _topk_overlap(a, b)
        return f"top-k overlap {share:.3f} (tolerance >= {OVERLAP_TOLERANCE})", share >= OVERLAP_TOLERANCE

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
               overlap)
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
                    lambda impl: nb.get_paged_mqa_logits_metadata(ctx, page, num_sms, impl=impl), exact)
        qi, qi_scale = quant_rows((xt @ w_iq).view(1, 1, index_heads, index_dim))
        wi = ((xt @ w_iw) * qi_scale.view(1, -1).amax(-1, keepdim=True) * (index_heads * index_dim) ** -0.5).float()
        feats = {"num_heads": index_heads, "head_dim": index_dim, "next_n": 1, "page_size": page,
                 "context_lens_2d": False}
        dl = call(phase, "fp8_paged_mqa_logits", feats,
                  lambda impl: nb.fp8_paged_mqa_logits(qi, idx_cache, wi, ctx, block_table, meta, t + 1,
                                                       clean_logits=True, impl=impl), logits_gap)
        logical = call(phase, "topk_indices", {"topk": topk, "n": t + 1},
                       lambda impl: nb.topk_indices(dl, topk, impl=impl),
                       overlap)
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


def _write_into(nb: Any, kv_t: torch.Tensor, cache: torch.Tensor, slot: int, impl: str) -> torch.Tensor:
    out = cache.clone()
    nb.write_fp8_ds_mla_cache(kv_t, out, torch.tensor([slot], dtype=torch.int64, device=cache.device), impl=impl)
    return out


def parse_device(text: str | None) -> torch.device:
    """The ``--device`` value as a torch device (default: CUDA when available); :class:`CliError`
    for anything but ``cpu``, ``cuda`` or ``cuda:N`` with an existing GPU ``N``."""
    if text is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text.strip())
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise CliError(f"--device {text}", "unknown device; accepted values: cpu, cuda, cuda:N")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CliError(f"--device {text}", "CUDA is not available on this machine; accepted values here: cpu")
    index = int(match.group(2) or 0)
    if index >= torch.cuda.device_count():
        last = torch.cuda.device_count() - 1
        raise CliError(f"--device {text}", f"no such GPU; accepted values here: cpu, cuda, cuda:0 to cuda:{last}")
    return torch.device("cuda", index)


def cpu_triton_mode() -> tuple[str, str]:
    """``(impl to request, how the rows run)`` for CPU tensors: the Triton interpreter when Triton
    is installed and the interpreter can still be switched on in this process, else the reference."""
    if envs.triton_interpret():
        return "triton", "Triton kernels in the CPU interpreter (TRITON_INTERPRET=1)"
    if importlib.util.find_spec("triton") is None:
        return "reference", "Triton is not installed: every row is the PyTorch reference itself"
    if "TRITON_INTERPRET" in os.environ or any(name.startswith(_KERNEL_PREFIX) for name in sys.modules):
        return "reference", "TRITON_INTERPRET is off: every row is the PyTorch reference itself"
    os.environ["TRITON_INTERPRET"] = "1"
    return "triton", "Triton kernels in the CPU interpreter (TRITON_INTERPRET=1)"


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``nsa-backend demo``: validate every flag, then run and print the layer."""
    device = parse_device(args.device)
    tokens = int_in_range("--tokens", args.tokens, 1, MAX_TOKENS)
    steps = int_in_range("--steps", args.steps, 0, MAX_STEPS)
    heads = int_in_range("--heads", args.heads, 1, MAX_HEADS, "the sparse MLA kernels' head limit")
    topk = int_in_range("--topk", args.topk, 1, min(tokens, MAX_TOPK),
                        "at most --tokens: the prefill keys a query selects from")
    try:
        get_config()
    except ConfigError as exc:
        raise CliError("config", str(exc)) from None
    requested, mode = ("auto", "routed for this GPU") if device.type == "cuda" else cpu_triton_mode()
    start = time.perf_counter()
    records = run_demo(device, prefill_tokens=tokens, steps=steps, heads=heads, topk=topk, requested=requested)
    wall = time.perf_counter() - start
    table = Table(title=f"DSA layer demo on {device} ({detect_arch(device)}; {mode}): prefill {tokens} tokens, "
                        f"{steps} decode steps, {heads} heads, top-k {topk}", title_justify="left")
    for col in ("phase", "op", "ran", "agreement with reference", "within tolerance", "ms"):
        table.add_column(col, justify="right" if col == "ms" else "left")
    interpreter = device.type == "cpu" and envs.triton_interpret()
    for r in records:
        ran = "triton (interpreter)" if r["impl"] == "triton" and interpreter else r["impl"]
        verdict = {True: "yes", False: "[bold red]NO[/bold red]", None: "-"}[r["ok"]]
        table.add_row(r["phase"], r["op"], ran, r["agreement"], verdict, f"{r['ms']:.2f}")
    out = Console(soft_wrap=False, width=180)
    out.print(table)
    checked = [r for r in records if r["ok"] is not None]
    failed = [r for r in checked if not r["ok"]]
    out.print(f"{len(checked)} of {len(records)} rows compared with the reference, {len(failed)} outside tolerance; "
              f"total wall time {wall:.2f} s (routed calls plus reference checks)")
    if failed:
        names = ", ".join(sorted({f"{r['op']} ({r['phase']})" for r in failed}))
        raise CliError("demo", f"{len(failed)} rows differ from the reference beyond tolerance: {names}", EXIT_INVALID)
    return EXIT_OK
