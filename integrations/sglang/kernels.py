"""DeepGEMM-compatible entry points on nsa-backend's routed ops, and where SGLang picks them up.

SGLang's DSA indexer (``layers/attention/dsa/dsa_indexer.py``) and backend (``dsa_backend.py``) get
their DeepGEMM functions from three resolvers of ``layers/attention/dsa/utils.py``
(``resolve_fp8_mqa_logits_fn``, ``resolve_fp8_paged_mqa_logits_fn``,
``resolve_paged_mqa_logits_metadata_fn``). :func:`activate_dsa` replaces the resolvers in those
modules, so every indexer call of a process that runs nsa-backend's backend lands on
:func:`fp8_mqa_logits`, :func:`fp8_paged_mqa_logits` and :func:`get_paged_mqa_logits_metadata`,
each ``impl="auto"`` (routed by GPU architecture, shape and the nsa-backend config).

The DeepSeek-V4 backend (``dsv4``) imports DeepGEMM inside its functions; :func:`activate_deep_gemm`
points the ``deep_gemm`` module's indexer and mHC functions at nsa-backend. A call that nsa-backend
routes back to DeepGEMM itself reaches the original function (a per-thread guard), so native
kernels still run where they exist.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import nsa_backend

logger = logging.getLogger("nsa_backend.sglang")

# SGLang modules holding a reference to the DSA resolvers.
DSA_RESOLVER_MODULES: tuple[str, ...] = (
    "sglang.srt.layers.attention.dsa.dsa_indexer",
    "sglang.srt.layers.attention.dsa_backend",
)
RESOLVERS: tuple[str, ...] = (
    "resolve_fp8_mqa_logits_fn",
    "resolve_fp8_paged_mqa_logits_fn",
    "resolve_paged_mqa_logits_metadata_fn",
)
DEEP_GEMM_FUNCTIONS: tuple[str, ...] = (
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "tf32_hc_prenorm_gemm",
)
_MARK = "__nsa_backend_route__"


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0):
    """``deep_gemm.fp8_mqa_logits`` signature on :func:`nsa_backend.fp8_mqa_logits`."""
    return nsa_backend.fp8_mqa_logits(
        q,
        kv,
        weights,
        cu_seq_len_k_start,
        cu_seq_len_k_end,
        clean_logits=clean_logits,
        max_seqlen_k=max_seqlen_k,
    )


def fp8_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits=False
):
    """``deep_gemm.fp8_paged_mqa_logits`` signature on :func:`nsa_backend.fp8_paged_mqa_logits`."""
    return nsa_backend.fp8_paged_mqa_logits(
        q,
        kv_cache,
        weights,
        context_lens,
        block_table,
        schedule_meta,
        max_context_len,
        clean_logits=clean_logits,
    )


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
    """``deep_gemm.get_paged_mqa_logits_metadata`` signature on nsa-backend's op."""
    return nsa_backend.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)


def tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits=None):
    """``deep_gemm.tf32_hc_prenorm_gemm`` signature on nsa-backend's op."""
    return nsa_backend.tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits=num_splits)


ROUTED: dict[str, Callable[..., Any]] = {
    "resolve_fp8_mqa_logits_fn": fp8_mqa_logits,
    "resolve_fp8_paged_mqa_logits_fn": fp8_paged_mqa_logits,
    "resolve_paged_mqa_logits_metadata_fn": get_paged_mqa_logits_metadata,
    "fp8_mqa_logits": fp8_mqa_logits,
    "fp8_paged_mqa_logits": fp8_paged_mqa_logits,
    "get_paged_mqa_logits_metadata": get_paged_mqa_logits_metadata,
    "tf32_hc_prenorm_gemm": tf32_hc_prenorm_gemm,
}

_lock = threading.Lock()
_dsa_active = False
_deep_gemm_active = False
_guard = threading.local()


def _resolver(name: str) -> Callable[[], Callable[..., Any]]:
    routed = ROUTED[name]

    def resolve() -> Callable[..., Any]:
        return routed

    resolve.__name__ = name
    resolve.__qualname__ = name
    setattr(resolve, _MARK, True)
    return resolve


def activate_dsa() -> list[str]:
    """Route the DSA indexer's DeepGEMM calls of this process to nsa-backend (idempotent).

    Returns the ``module.name`` bindings replaced by this call.
    """
    global _dsa_active
    replaced: list[str] = []
    with _lock:
        if _dsa_active:
            return replaced
        for module_name in DSA_RESOLVER_MODULES:
            module = importlib.import_module(module_name)
            for name in RESOLVERS:
                current = getattr(module, name, None)
                if current is None or getattr(current, _MARK, False):
                    continue
                setattr(module, name, _resolver(name))
                replaced.append(f"{module_name}.{name}")
        _dsa_active = True
    logger.info(
        "nsa-backend: DSA indexer kernels routed to nsa-backend (%s)", ", ".join(replaced) or "already"
    )
    return replaced


def dsa_active() -> bool:
    return _dsa_active


def _guarded(original: Callable[..., Any], routed: Callable[..., Any]) -> Callable[..., Any]:
    """Call ``routed`` unless already inside it on this thread (then ``original``: the native kernel)."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_guard, "depth", 0):
            return original(*args, **kwargs)
        _guard.depth = 1
        try:
            return routed(*args, **kwargs)
        finally:
            _guard.depth = 0

    setattr(call, _MARK, True)
    call.__wrapped__ = original
    return call


def activate_deep_gemm() -> list[str]:
    """Point ``deep_gemm``'s indexer and mHC functions at nsa-backend (idempotent).

    Used for the DeepSeek-V4 backend, which calls DeepGEMM directly. Returns the names replaced;
    empty when DeepGEMM is not installed.
    """
    global _deep_gemm_active
    with _lock:
        if _deep_gemm_active:
            return []
        try:
            deep_gemm = importlib.import_module("deep_gemm")
        except Exception as exc:  # an installed DeepGEMM can fail to load its CUDA library
            logger.warning(
                "nsa-backend: deep_gemm not importable (%s); DeepSeek-V4 indexer calls not routed", exc
            )
            return []
        replaced = []
        for name in DEEP_GEMM_FUNCTIONS:
            original = getattr(deep_gemm, name, None)
            if original is None or getattr(original, _MARK, False):
                continue
            setattr(deep_gemm, name, _guarded(original, ROUTED[name]))
            replaced.append(f"deep_gemm.{name}")
        _deep_gemm_active = True
    logger.info("nsa-backend: %s routed to nsa-backend", ", ".join(replaced) or "nothing")
    return replaced
