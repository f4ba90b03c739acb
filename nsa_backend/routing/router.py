"""Per-call implementation choice: ``select_impl(op, requested, features) -> impl name``.

``requested == "auto"``: the user's configuration first (environment, then the config file's
model / arch / defaults sections), then the capability table: a native kernel when its package
imports and it supports the shape (zero-padding heads where that makes it usable), else Triton.
Where the Triton kernels were measured faster than a native kernel on padded heads
(:data:`capabilities.TRITON_OVER_PADDED`), Triton is taken instead of padding.
CPU tensors get the plain PyTorch reference under ``"auto"``; ``"triton"`` (asked for by name, by
the environment or by the config file) runs the Triton kernels on CPU tensors in the interpreter
when ``TRITON_INTERPRET=1``. On a GPU the reference is used only when asked for (or for the few ops
without a GPU kernel).

An explicit ``requested`` name is checked against the table and raises ``ValueError`` naming the
op, the implementation, the arch, why, and the valid choices -- except ``"reference"``, which is
always allowed.

Decisions are cached per ``(op, requested, arch, model, shape class)``; the shape class holds only
the features some table row looks at (:data:`capabilities.SHAPE_FEATURES`), so a call with a new
sequence length hits the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from nsa_backend import _settings, envs
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import device as _device
from nsa_backend.routing import implementations
from nsa_backend.routing.config import Config, get_config
from nsa_backend.routing.device import DEEPSEEK_V4, detect_arch
from nsa_backend.routing.validate import CHOICE_TO_IMPL

logger = logging.getLogger("nsa_backend")

# Config key (op family) governing each op. A family value naming an implementation the op does
# not have (``decode = "flash_mla"`` for ``pack_fp8_ds_mla``) leaves that op on the automatic route.
OP_FAMILY: dict[str, str | None] = {
    "fp8_mqa_logits": "indexer",
    "get_paged_mqa_logits_metadata": "indexer",
    "fp8_paged_mqa_logits": "indexer",
    "pack_indexer_k_cache": "indexer",
    "fp8_fp4_mqa_logits": "indexer",
    "fp8_fp4_paged_mqa_logits": "indexer",
    "pack_indexer_k_cache_fp4": "indexer",
    "topk_indices": "topk",
    "logical_to_global_indices": "topk",
    "flash_mla_sparse_fwd": "prefill",
    "sparse_mla_decode": "decode",
    "pack_fp8_ds_mla": "decode",
    "unpack_fp8_ds_mla": "decode",
    "write_fp8_ds_mla_cache": "decode",
    "pack_fp8_ds_mla_v4": "decode",
    "unpack_fp8_ds_mla_v4": "decode",
    "write_fp8_ds_mla_v4_cache": "decode",
    "tf32_hc_prenorm_gemm": "hc_prenorm",
}
# Order in which "auto" tries implementations (the first usable one wins).
_AUTO_ORDER: tuple[str, ...] = ("deep_gemm", "flash_mla", "flashinfer", "triton")

# Ops whose reference is plain indexing and element-wise work: on a GPU it runs as a few fused torch
# kernels at memory speed, so "reference" is their GPU route and not a fallback.
TENSOR_OPS: frozenset[str] = frozenset({"pack_indexer_k_cache", "unpack_fp8_ds_mla", "pack_indexer_k_cache_fp4"})


@dataclasses.dataclass(frozen=True)
class Decision:
    """A routing decision with its provenance (what ``nsa-backend plan`` prints)."""

    op: str
    impl: str
    source: str
    reason: str = ""
    padded: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CacheStats:
    """Counters of the decision cache (``hits`` grows on every cached call)."""

    hits: int = 0
    misses: int = 0


stats = CacheStats()
_cache: dict[tuple, str] = {}
_arch_cache: dict[torch.device, str] = {}
_warned: set[tuple] = set()
_lock = threading.Lock()
_active_model: str | None = None


def clear_cache() -> None:
    """Drop cached decisions (after a configuration or environment change)."""
    with _lock:
        _cache.clear()
        _arch_cache.clear()
        _warned.clear()
        stats.hits = 0
        stats.misses = 0
    _implemented.cache_clear()
    padded_heads.cache_clear()
    caps._probe_cache.clear()


def set_active_model(architecture: str | None) -> None:
    """Name the HF architecture being served, so ``[model.<architecture>]`` config sections apply.

    Called by the SGLang / vLLM integrations when the model is loaded; a call may also pass
    ``features["model"]``.
    """
    global _active_model
    _active_model = architecture
    _settings.settings_changed()  # clears the decisions here (registered below) and every other cache


def active_model() -> str | None:
    return _active_model


@functools.cache
def _implemented(op: str) -> tuple[str, ...]:
    """Implementations of ``op`` present in this installation (Triton only when its module exists)."""
    table = implementations.IMPLEMENTATIONS.get(op)
    if table is None:
        raise ValueError(f"unknown op {op!r}; known ops: {list(caps.OPS)}")
    present = set(implementations.available_impls(op))
    return tuple(impl for impl in table if impl != "triton" or "triton" in present)


def valid_impls(op: str, arch: str, features: Mapping[str, Any],
                natives: Mapping[str, caps.NativeStatus] | None = None) -> list[str]:
    """Explicit implementation names that would be accepted for this call."""
    out = ["auto", "reference"]
    for impl in _implemented(op):
        if impl == "reference":
            continue
        if arch == "cpu":
            if impl == "triton" and envs.triton_interpret():
                out.append(impl)
            continue
        if caps.evaluate(op, impl, arch, features, natives).ok:
            out.append(impl)
    return out


def _reject(op: str, impl: str, arch: str, why: str, features: Mapping[str, Any],
            natives: Mapping[str, caps.NativeStatus] | None) -> ValueError:
    valid = valid_impls(op, arch, features, natives)
    return ValueError(f"{op}: impl={impl!r} is not usable on {arch}: {why}. Valid choices for this call: {valid}")


def _cpu_refusal(impl: str) -> str:
    hint = " (with TRITON_INTERPRET=1 it runs in the Triton interpreter)" if impl == "triton" else ""
    return f"{impl} needs a GPU and the tensors are on the CPU{hint}"


def decide(op: str, requested: str, arch: str, features: Mapping[str, Any], *, model: str | None = None,
           config: Config | None = None, natives: Mapping[str, caps.NativeStatus] | None = None) -> Decision:
    """Route one call without caching (see the module docstring for the rules)."""
    if op not in OP_FAMILY:
        raise ValueError(f"unknown op {op!r}; known ops: {list(caps.OPS)}")
    implemented = _implemented(op)
    if requested != "auto":
        if requested == "reference":
            return Decision(op, "reference", "impl argument", "plain PyTorch, runs anywhere")
        if requested not in caps.IMPLS:
            raise ValueError(f"{op}: unknown impl {requested!r}; known implementations: "
                             f"{['auto', *caps.IMPLS]}")
        if requested not in implemented:
            raise _reject(op, requested, arch, f"nsa-backend has no {requested} implementation of {op}",
                          features, natives)
        if arch == "cpu":
            if requested == "triton" and envs.triton_interpret():
                return Decision(op, "triton", "impl argument", "Triton CPU interpreter (TRITON_INTERPRET=1)")
            raise _reject(op, requested, arch, _cpu_refusal(requested), features, natives)
        verdict = caps.evaluate(op, requested, arch, features, natives)
        if not verdict.ok:
            raise _reject(op, requested, arch, verdict.reason, features, natives)
        return Decision(op, requested, "impl argument", verdict.reason, verdict.padded)

    cfg = config if config is not None else get_config()
    family = OP_FAMILY[op]
    if family is not None:
        choice, source = cfg.choice(family, arch, model)
        if choice == "reference":
            return Decision(op, "reference", source, "configured")
        if choice != "auto" and choice in implemented:
            if arch == "cpu" and choice == "triton" and envs.triton_interpret():
                verdict = caps.Verdict(True, "Triton CPU interpreter (TRITON_INTERPRET=1)")
            elif arch == "cpu":
                verdict = caps.Verdict(False, _cpu_refusal(choice))
            else:
                verdict = caps.evaluate(op, choice, arch, features, natives)
            if verdict.ok:
                return Decision(op, choice, source, verdict.reason or "configured", verdict.padded)
            _warn_once((op, choice, arch, source),
                       f"{source} selects {choice} for {op}, but it is not usable here ({verdict.reason}); "
                       f"using the automatic route")
    if arch == "cpu":
        return Decision(op, "reference", "auto", "CPU tensors: plain PyTorch reference")
    reasons = []
    for impl in _AUTO_ORDER:
        if impl not in implemented:
            continue
        verdict = caps.evaluate(op, impl, arch, features, natives)
        if verdict.ok and "num_heads" in verdict.padded and "triton" in implemented:
            faster = caps.triton_over_padded(op, arch, features)
            if faster is not None:
                reasons.append(f"{impl} would pad num_heads {features['num_heads']} to "
                               f"{verdict.padded['num_heads']}; {faster}")
                continue
        if verdict.ok:
            note = verdict.reason or (caps.TRITON_NOTE if impl == "triton" else "native kernel")
            if reasons and impl == "triton":
                note = f"{note}; " + "; ".join(reasons)
            return Decision(op, impl, "auto", note, verdict.padded)
        if impl != "triton":
            reasons.append(verdict.reason)
    if op in TENSOR_OPS:
        return Decision(op, "reference", "auto", "vectorised PyTorch tensor op (runs on the GPU; no kernel needed)")
    return Decision(op, "reference", "auto", f"no GPU kernel of {op} in this installation")


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _arch_of(device: Any) -> str:
    if device is None:
        return detect_arch(None)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    arch = _arch_cache.get(device)
    if arch is None:
        arch = detect_arch(device)
        _arch_cache[device] = arch
    return arch


def select_impl(op: str, requested: str, features: Mapping[str, Any]) -> str:
    """Concrete implementation name for one call of public op ``op``.

    Parameters
    ----------
    op : str
        Public op name, e.g. ``"fp8_mqa_logits"``.
    requested : str
        ``"auto"`` or an implementation name (``"reference"``, ``"triton"``, ``"deep_gemm"``,
        ``"flash_mla"``, ``"flashinfer"``).
    features : dict
        ``device`` (``torch.device`` of the inputs) plus the op's shape features
        (``num_heads``, ``head_dim``, ``d_qk``, ``topk``, ``kv_format``, ``next_n``,
        ``page_size``, ``n``, ``k``, ...). Optional ``arch`` overrides device detection and
        ``model`` names the HF architecture for ``[model.*]`` config sections.

    Returns
    -------
    str
        The implementation to call. Raises ``ValueError`` for an explicit name that cannot run
        this call.
    """
    arch = features.get("arch") or _arch_of(features.get("device"))
    model = features.get("model", _active_model)
    shape = caps.SHAPE_FEATURES.get(op)
    # the CPU route depends on the interpreter switch, Triton over padded natives on the Gluon switch
    key = (op, requested, arch, model, tuple(features.get(k) for k in shape) if shape else None,
           arch == "cpu" and envs.triton_interpret(), envs.get(envs.GLUON, "1"))
    impl = _cache.get(key)
    if impl is not None:
        stats.hits += 1
        return impl
    decision = decide(op, requested, arch, features, model=model)
    with _lock:
        stats.misses += 1
        _cache[key] = decision.impl
    logger.debug("route %s (%s, %s): %s [%s] %s", op, requested, arch, decision.impl, decision.source,
                 decision.reason)
    return decision.impl


@functools.cache
def padded_heads(op: str, impl: str, num_heads: int, arch: str) -> int:
    """Head count ``impl`` runs ``op`` with on ``arch`` (``num_heads`` or the next supported count)."""
    status = caps.probe_natives()
    for row in caps.rows(op, impl):
        if arch not in row.archs:
            continue
        if row.package is not None:
            native = status.get(row.package)
            if native is None or not native.available or not row.version_ok(native.effective_version):
                continue
        for name, constraint in row.where:
            if name == "num_heads" and isinstance(constraint, caps.OneOf):
                target = constraint.pad_to(num_heads)
                if target is not None:
                    return int(target)
    return num_heads


def get_padded_heads(op: str, impl: str, num_heads: int, device: torch.device | str | None = None,
                     arch: str | None = None) -> int:
    """Number of heads a native kernel needs for ``num_heads`` real ones.

    DeepGEMM's indexer takes H in {32, 64} on SM90 and {8, 16, 32, 64} on SM100, FlashMLA h_q in
    {64, 128}, FlashInfer's SM120 decode fixed head buckets. A smaller count is padded up with
    zero heads (zero indexer weights, zero queries whose output is dropped); the result is then
    unchanged. Returns ``num_heads`` when no padding is needed or possible. Without ``arch`` the
    GPU of ``device`` decides (a forced routing arch does not change what the hardware accepts).
    """
    if arch is None:
        arch = _device.hardware_arch(device)
    return padded_heads(op, impl, int(num_heads), arch)


def _padded_heads_for(op: str, impl: str, num_heads: int, device: Any) -> int:
    return get_padded_heads(op, impl, num_heads, device=device)


# Lower layers reach routing's state through ``nsa_backend._settings``: the native wrappers ask it for the
# head count to pad to, and a configuration change drops the decisions cached here.
_settings.set_padded_heads_source(_padded_heads_for)
_settings.on_settings_change(clear_cache)


# ----------------------------------------------------------------------------------------------
# Whole-model plans (``nsa-backend plan`` / ``doctor``)
# ----------------------------------------------------------------------------------------------

def model_op_features(info: Any, *, tp: int = 1, kv_cache_dtype: str = "fp8_e4m3", next_n: int = 1,
                      page_size: int = 64) -> dict[str, dict[str, Any]]:
    """Shape features of every op one attention layer of ``info`` (a :class:`ModelInfo`) calls, as
    the public ops report them to :func:`select_impl`.

    DeepSeek-V3.2 / GLM-5 (``d_qk`` 576) keep an FP8 cache in the 656-byte ``fp8_ds_mla`` format.
    DeepSeek-V4 (``d_qk`` 512) keeps its FP8 cache in the 584-byte ``fp8_ds_mla_v4`` format, written
    and read by the V4 cache ops, and its indexer is listed twice: the FP8 key cache
    (``fp8_*mqa_logits``, as SGLang calls it) and the MXFP4 key cache with MXFP4 queries
    (``fp8_fp4_*mqa_logits``, as vLLM calls it). A bf16 cache is the ``bf16`` format for every model.
    """
    heads = info.heads_per_rank(tp)
    fp8 = kv_cache_dtype in ("fp8_e4m3", "fp8", "fp8_ds_mla")
    v4 = info.family == DEEPSEEK_V4
    if not fp8:
        kv_format = "bf16"
    elif v4:
        kv_format = "fp8_ds_mla_v4"
    else:
        kv_format = "fp8_ds_mla" if info.d_qk == 576 else "bf16"
    ops: dict[str, dict[str, Any]] = {
        "fp8_mqa_logits": {"num_heads": info.index_n_heads, "head_dim": info.index_head_dim, "compressed": False},
        "get_paged_mqa_logits_metadata": {"page_size": page_size},
        "fp8_paged_mqa_logits": {"num_heads": info.index_n_heads, "head_dim": info.index_head_dim,
                                 "next_n": next_n, "page_size": page_size, "context_lens_2d": True},
        "pack_indexer_k_cache": {},
    }
    if v4:
        # The FP4 indexer's head dim is fixed (128) by its 68-byte rows, so it is no feature of the op.
        ops["fp8_fp4_mqa_logits"] = {"num_heads": info.index_n_heads, "q_fp4": True, "compressed": False}
        ops["fp8_fp4_paged_mqa_logits"] = {"num_heads": info.index_n_heads, "next_n": next_n,
                                           "page_size": page_size, "q_fp4": True, "context_lens_2d": True}
        ops["pack_indexer_k_cache_fp4"] = {}
    ops["topk_indices"] = {"topk": info.index_topk}
    ops["logical_to_global_indices"] = {"page_size": page_size}
    ops["flash_mla_sparse_fwd"] = {"num_heads": heads, "d_qk": info.d_qk, "topk": info.index_topk}
    ops["sparse_mla_decode"] = {"num_heads": heads, "d_qk": info.d_qk, "topk": info.index_topk, "s_q": next_n,
                                "kv_format": kv_format, "page_size": page_size}
    if kv_format == "fp8_ds_mla":
        ops["pack_fp8_ds_mla"] = {}
        ops["write_fp8_ds_mla_cache"] = {}
        ops["unpack_fp8_ds_mla"] = {}
    elif kv_format == "fp8_ds_mla_v4":
        ops["pack_fp8_ds_mla_v4"] = {}
        ops["write_fp8_ds_mla_v4_cache"] = {}
        ops["unpack_fp8_ds_mla_v4"] = {}
    if info.hc_mult:
        ops["tf32_hc_prenorm_gemm"] = {"n": info.hc_mult * (2 + info.hc_mult), "k": info.hc_mult * info.hidden_size}
    return ops


def plan_routes(info: Any, arch: str, *, kv_cache_dtype: str = "fp8_e4m3", tp: int = 1, prefill_impl: str = "auto",
                decode_impl: str = "auto", next_n: int = 1, natives: Mapping[str, caps.NativeStatus] | None = None,
                config: Config | None = None) -> list[Decision]:
    """Route of every op of ``info`` on ``arch`` (validate the prefill/decode choice first).

    A prefill/decode choice served by the framework's own kernel (``fa3``, ``tilelang``, ``trtllm``,
    ...) appears as ``framework:<name>``.
    """
    phase_choice = {"flash_mla_sparse_fwd": ("--prefill-impl", prefill_impl),
                    "sparse_mla_decode": ("--decode-impl", decode_impl)}
    out = []
    for op, features in model_op_features(info, tp=tp, kv_cache_dtype=kv_cache_dtype, next_n=next_n).items():
        requested, flag = "auto", None
        if op in phase_choice:
            flag, choice = phase_choice[op]
            requested = CHOICE_TO_IMPL.get(choice) or f"framework:{choice}"
        if requested.startswith("framework:"):
            out.append(Decision(op, requested, flag, "kernel of the serving framework, outside nsa-backend"))
            continue
        try:
            decision = decide(op, requested, arch, features, model=info.architecture, config=config, natives=natives)
        except ValueError as exc:
            if flag is None:
                raise
            choice = phase_choice[op][1]
            decision = Decision(op, f"framework:{choice}", flag,
                                f"the framework's {choice} kernel (nsa-backend's: {exc})")
        else:
            if flag is not None and requested != "auto":
                decision = dataclasses.replace(decision, source=flag)
            if decision.impl == "triton":
                decision = _with_triton_kernel(decision, arch, features)
        out.append(decision)
    return out


def _with_triton_kernel(decision: Decision, arch: str, features: Mapping[str, Any]) -> Decision:
    """``decision`` whose reason names the Triton kernel the call takes, where the op's launcher picks one."""
    # Imported on use: it loads the sparse MLA kernel modules, which the ops' dispatch loads at their first call
    # only (importing nsa_backend stays quick).
    from nsa_backend.routing.triton_kernels import planned_triton_kernel

    kernel = planned_triton_kernel(decision.op, arch, features)
    if kernel is None:
        return decision
    if decision.reason.startswith(caps.TRITON_NOTE):
        reason = f"Triton: {kernel}{decision.reason[len(caps.TRITON_NOTE):]}"
    else:
        reason = f"Triton: {kernel}; {decision.reason}" if decision.reason else f"Triton: {kernel}"
    return dataclasses.replace(decision, reason=reason)
