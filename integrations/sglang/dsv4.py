"""DeepSeek-V4 attention of SGLang's ``dsv4`` backend on nsa-backend's ops where no native kernel serves it.

SGLang's DeepSeek-V4 backend (``layers/attention/deepseek_v4_backend.py``) reaches its attention
kernels through module functions it looks up when it runs:

- sparse decode (SM90 / SM100 / SM8x): ``flash_mla_interface.flash_mla_with_kvcache``, read once per
  backend by ``DeepseekV4Backend.__init__`` into a ``functools.partial`` (so it must be replaced before
  the backend is built: the plugin does it when it loads, before any model runner exists);
- sparse decode on SM120 / SM121: ``flash_mla_sm120.flash_mla_with_kvcache_sm120`` (read per call);
- sparse prefill: ``flash_mla_interface.flash_mla_sparse_fwd`` (read per call);
- the decode schedule placeholder: ``flash_mla_interface.get_mla_metadata`` (read per batch);
- the V4 KV-cache write: ``fused_store_cache``, bound into ``mem_cache/deepseek_v4_memory_pool.py`` by
  ``from ... import`` when SGLang imports it, so the pool module's global is replaced. It is the write of
  ``backend.store_cache`` (SGLang's bf16-source setting, context-parallel prefill); by default the model
  writes the sliding-window keys with SGLang's own JIT kernel ``fused_k_norm_rope_flashmla``, compiled
  for the GPU it runs on, in the same 584-byte layout, and that write stays SGLang's.

:func:`activate` replaces each of them with a function of the same signature that decides per call
(:func:`decode_route`, :func:`prefill_route`, :func:`store_route`, from :mod:`nsa_backend.routing`):
the call goes to SGLang's original function where a native kernel serves the arch and the
``(heads, topk)`` shape (FlashMLA on SM90 / SM100, FlashInfer's DeepSeek-V4 decode on SM120 where
the installed FlashInfer lists the head count), and to nsa-backend's ops otherwise
(:func:`nsa_backend.sparse_mla_decode` with ``kv_format="fp8_ds_mla_v4"`` and the extra
(compressed) key list, :func:`nsa_backend.flash_mla_sparse_fwd` with ``d_qk = 512``, sink and
``topk_length``, :func:`nsa_backend.write_fp8_ds_mla_v4_cache`). Only SGLang's 584-byte V4 cache
(448 e4m3 + 64 bf16 rope + 8 UE8M0 scale bytes per token, block-split pages) is served; the V4.1
layouts (528 / 288 bytes) always go to SGLang's own kernels.

Where FlashMLA's library cannot load at all (no FlashMLA build for the machine, or no CUDA),
SGLang's ``flash_mla_interface`` module cannot be imported; :func:`activate` then provides a module
of that name holding only the functions above, so the ``dsv4`` backend's imports find them.

The DeepGEMM indexer functions the backend calls (``fp8_mqa_logits``, ``fp8_paged_mqa_logits``,
``get_paged_mqa_logits_metadata``, ``tf32_hc_prenorm_gemm``) are routed by
:func:`nsa_backend_integrations.sglang.kernels.activate_deep_gemm`; :data:`DEEP_GEMM_V4_FUNCTIONS`
adds the MXFP4 indexer (``fp8_fp4_paged_mqa_logits``, ``fp8_fp4_mqa_logits``), whose DeepGEMM
signature differs from nsa-backend's (``clean_logits`` before ``logits_dtype``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

import nsa_backend
from nsa_backend.reference import V4_HEAD_DIM, V4_TOKEN_BYTES
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import router
from nsa_backend.routing.device import detect_arch
from nsa_backend_integrations.sglang import kernels

logger = logging.getLogger("nsa_backend.sglang")

FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"
FLASH_MLA_SM120 = "sglang.kernels.ops.attention.flash_mla_sm120"
V4_MEMORY_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
NATIVE_PASS = "sglang"
"""Route target: SGLang's own (native) function."""
OURS = "nsa_backend"
"""Route target: nsa-backend's op."""
SM120_ARCHS = ("sm120", "sm121")
# Arch families on which SGLang runs its DeepSeek-V4 JIT store kernel (its V4 path is built for SM90 on).
STORE_NATIVE_ARCHS = ("sm90", "sm100", "sm103", "sm120", "sm121")
# FlashMLA's split-KV threshold as SGLang's interface states it (read only by SGLang's V4.1 scheduling,
# which the substitute module never serves).
SPLIT_KV_MIN_TOPK = 641
_LOG2E = 1.0 / math.log(2.0)
_MARK = "__nsa_backend_dsv4__"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one call goes: ``target`` is :data:`NATIVE_PASS` or :data:`OURS`; ``impl`` the nsa-backend
    implementation for :data:`OURS` (``triton``, ``reference``) or the native one for :data:`NATIVE_PASS`."""

    target: str
    impl: str
    reason: str


def _v4_decode_features(num_heads: int, topk: int, s_q: int, page_size: int) -> dict[str, Any]:
    return {"num_heads": num_heads, "d_qk": V4_HEAD_DIM, "topk": topk, "s_q": s_q,
            "kv_format": "fp8_ds_mla_v4", "page_size": page_size}


def sglang_flashinfer_v4_decode(num_heads: int, num_tokens: int) -> bool:
    """Whether SGLang's SM120 path runs FlashInfer's DeepSeek-V4 kernel for this call (its
    ``SGLANG_SM120_FLASHMLA_BACKEND`` is ``flashinfer`` and the installed FlashInfer lists the head
    count for decode-sized calls; larger calls go to FlashInfer's paged prefill, any head count)."""
    try:
        sm120 = importlib.import_module(FLASH_MLA_SM120)
        if getattr(sm120, "_sm120_default_backend", None) != "flashinfer":
            return False
        if num_tokens > int(getattr(sm120, "SM120_DECODE_MAX_TOKENS", 64)):
            importlib.import_module("flashinfer.mla._sparse_mla_sm120")
            return True
        return bool(sm120.flashinfer_dsv4_decode_supports_num_heads(num_heads, num_tokens))
    except Exception:  # no FlashInfer (or an older one without the V4 kernels): not served
        return False


def decode_route(arch: str, num_heads: int, topk: int, *, s_q: int = 1, num_tokens: int = 1, page_size: int = 256,
                 natives: Mapping[str, caps.NativeStatus] | None = None,
                 flashinfer_v4: Callable[[int, int], bool] = sglang_flashinfer_v4_decode) -> Route:
    """Route of one V4 sparse decode call (``num_heads`` query heads, ``topk`` main indices).

    FlashMLA where :func:`nsa_backend.routing.router.decide` picks it for the V4 decode op (SM90 /
    SM100, head counts it serves after padding); on SM120 / SM121 FlashInfer where SGLang would run it
    (``flashinfer_v4(num_heads, num_tokens)``); nsa-backend's routed implementation otherwise.
    """
    decision = router.decide("sparse_mla_decode", "auto", arch, _v4_decode_features(num_heads, topk, s_q, page_size),
                             natives=natives)
    if decision.impl == "flash_mla":
        return Route(NATIVE_PASS, "flash_mla", decision.reason or "FlashMLA serves the V4 decode")
    if arch in SM120_ARCHS and flashinfer_v4(num_heads, num_tokens):
        return Route(NATIVE_PASS, "flashinfer", "SGLang's FlashInfer SM120 DeepSeek-V4 kernel serves this call")
    return Route(OURS, decision.impl, decision.reason)


def prefill_route(arch: str, num_heads: int, topk: int, *,
                  natives: Mapping[str, caps.NativeStatus] | None = None) -> Route:
    """Route of one V4 sparse prefill call (``flash_mla_sparse_fwd`` over the bf16 workspace, d_qk 512)."""
    decision = router.decide("flash_mla_sparse_fwd", "auto", arch,
                             {"num_heads": num_heads, "d_qk": V4_HEAD_DIM, "topk": topk}, natives=natives)
    if decision.impl == "flash_mla":
        return Route(NATIVE_PASS, "flash_mla", decision.reason or "FlashMLA serves the V4 prefill")
    return Route(OURS, decision.impl, decision.reason)


def store_route(arch: str) -> Route:
    """Route of one V4 KV-cache write: SGLang's JIT store kernel on the archs its V4 path is built for,
    :func:`nsa_backend.write_fp8_ds_mla_v4_cache` elsewhere (SM8x, CPU tensors)."""
    if arch in STORE_NATIVE_ARCHS:
        return Route(NATIVE_PASS, "sglang_jit", f"SGLang's V4 store kernel runs on {arch}")
    decision = router.decide("write_fp8_ds_mla_v4_cache", "auto", arch, {})
    return Route(OURS, decision.impl, decision.reason)


# -- replacements ---------------------------------------------------------------------------------


def _u8(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _is_v4_cache(cache: torch.Tensor | None) -> bool:
    return cache is None or cache.shape[-1] == V4_TOKEN_BYTES


def _ours_decode(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int, softmax_scale: float | None,
                 indices: torch.Tensor, topk_length: torch.Tensor | None, attn_sink: torch.Tensor | None,
                 extra_k_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                 extra_topk_length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's V4 decode contract on :func:`nsa_backend.sparse_mla_decode`."""
    if q.dim() == 3:  # [B, h_q, d_qk]: one query row per request
        q = q.unsqueeze(1)
    if indices.dim() == 2:
        indices = indices.unsqueeze(1)
    if extra_indices is not None and extra_indices.dim() == 2:
        extra_indices = extra_indices.unsqueeze(1)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return nsa_backend.sparse_mla_decode(
        q,
        _u8(k_cache),
        indices.to(torch.int32),
        scale,
        head_dim_v,
        "fp8_ds_mla_v4",
        attn_sink.float() if attn_sink is not None else None,
        topk_length.to(torch.int32) if topk_length is not None else None,
        extra_kv_cache=_u8(extra_k_cache) if extra_k_cache is not None else None,
        extra_indices=extra_indices.to(torch.int32) if extra_indices is not None else None,
        extra_topk_length=extra_topk_length.to(torch.int32) if extra_topk_length is not None else None,
    )


def _decode_call_route(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor | None) -> Route | None:
    """Route of a decode call, or ``None`` when it is not a V4 sparse call nsa-backend serves."""
    if indices is None or q.shape[-1] != V4_HEAD_DIM or k_cache.shape[-1] != V4_TOKEN_BYTES:
        return None
    s_q = q.shape[1] if q.dim() == 4 else 1
    return decode_route(detect_arch(q.device), q.shape[-2], indices.shape[-1], s_q=s_q, num_tokens=q.shape[0],
                        page_size=k_cache.shape[1])


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: Any,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    kv_format: str | None = None,
    *,
    use_legacy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``flash_mla_interface.flash_mla_with_kvcache``: V4 sparse decode on nsa-backend's op where no
    native kernel serves it, SGLang's FlashMLA call otherwise.

    Returns ``(out [B, s_q, h_q, head_dim_v] bf16, lse [B, h_q, s_q] float32)`` (natural log, as FlashMLA).
    The schedule arguments (``tile_scheduler_metadata``, ``num_splits``) are FlashMLA's and unused here.
    """
    route = None if block_table is not None or not _is_v4_cache(extra_k_cache) else _decode_call_route(
        q, k_cache, indices)
    if route is None or route.target == NATIVE_PASS:
        original = _ORIGINALS.get((FLASH_MLA_INTERFACE, "flash_mla_with_kvcache"))
        if original is None:
            raise RuntimeError("flash_mla_with_kvcache: FlashMLA cannot be loaded on this machine and the call "
                               f"is not a DeepSeek-V4 sparse decode nsa-backend serves ({route})")
        return original(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                        softmax_scale, causal, descale_q, descale_k, is_fp8_kvcache, indices, attn_sink,
                        extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length, kv_format,
                        use_legacy=use_legacy)
    return _ours_decode(q, k_cache, head_dim_v, softmax_scale, indices, topk_length, attn_sink, extra_k_cache,
                        extra_indices_in_kvcache, extra_topk_length)


def flash_mla_with_kvcache_sm120(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SGLang's ``flash_mla_sm120.flash_mla_with_kvcache_sm120`` (keyword-only, as SGLang calls it).

    FlashInfer's SM120 kernel where SGLang runs it for this head count, nsa-backend's decode otherwise
    (SGLang's Triton / torch fallbacks read fp8 with instructions of compute capability 8.9 and newer).
    Returns ``(out [B, s_q, h_q, head_dim_v], lse [B, h_q, s_q])``.
    """
    q, k_cache = kwargs["q"], kwargs["k_cache"]
    extra = kwargs.get("extra_k_cache")
    route = _decode_call_route(q, k_cache, kwargs.get("indices")) if _is_v4_cache(extra) else None
    if route is None or route.target == NATIVE_PASS:
        return _ORIGINALS[(FLASH_MLA_SM120, "flash_mla_with_kvcache_sm120")](**kwargs)
    return _ours_decode(q, k_cache, kwargs["head_dim_v"], kwargs.get("softmax_scale"), kwargs["indices"],
                        kwargs.get("topk_length"), kwargs.get("attn_sink"), extra,
                        kwargs.get("extra_indices_in_kvcache"), kwargs.get("extra_topk_length"))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    use_legacy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``flash_mla_interface.flash_mla_sparse_fwd``: V4 sparse prefill over the bf16 workspace.

    ``q [s_q, h_q, 512]``, ``kv [s_kv, 1, 512]``, ``indices [s_q, 1, topk]`` (rows of ``kv``; ``-1``
    skipped), ``topk_length [s_q]``, ``attn_sink [h_q]``. Returns ``(out [s_q, h_q, d_v] bf16,
    max_logits [s_q, h_q], lse [s_q, h_q])``; with ``use_legacy`` (SGLang's default) the statistics are
    base 2 (natural-log values times ``log2(e)``), as FlashMLA's legacy kernel returns them.
    """
    route = None
    if q.shape[-1] == V4_HEAD_DIM:
        route = prefill_route(detect_arch(q.device), q.shape[-2], indices.shape[-1])
    if route is None or route.target == NATIVE_PASS:
        original = _ORIGINALS.get((FLASH_MLA_INTERFACE, "flash_mla_sparse_fwd"))
        if original is None:
            raise RuntimeError("flash_mla_sparse_fwd: FlashMLA cannot be loaded on this machine and the call is "
                               f"not a DeepSeek-V4 sparse prefill nsa-backend serves ({route})")
        return original(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=use_legacy)
    out, max_logits, lse = nsa_backend.flash_mla_sparse_fwd(
        q, kv, indices.to(torch.int32), float(sm_scale), d_v,
        attn_sink.float() if attn_sink is not None else None,
        topk_length.to(torch.int32) if topk_length is not None else None)
    if use_legacy:
        max_logits, lse = max_logits * _LOG2E, lse * _LOG2E
    return out, max_logits, lse


def get_mla_metadata(cache_seqlens: torch.Tensor | None = None, num_q_tokens_per_head_k: int | None = None,
                     num_heads_k: int | None = None, num_heads_q: int | None = None, is_fp8_kvcache: bool = False,
                     topk: int | None = None) -> tuple[Any, Any]:
    """SGLang's ``flash_mla_interface.get_mla_metadata``: FlashMLA's schedule where FlashMLA loads, else
    ``(None, None)`` (nsa-backend's decode needs no schedule; SGLang's SM120 path passes ``None`` too)."""
    original = _ORIGINALS.get((FLASH_MLA_INTERFACE, "get_mla_metadata"))
    if original is None:
        return None, None
    return original(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk)


def fused_store_cache(input: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, *, page_size: int,
                      type: str, layout: Any = "v4", freqs_cis: torch.Tensor | None = None) -> None:
    """SGLang's ``fused_store_cache`` as the V4 memory pool calls it: quantise ``input [T, 512]`` (bf16,
    normed and rotated) into the raw page buffer ``cache [num_pages, page_bytes]`` at slots ``indices``.

    The 584-byte V4 layout (``type="flashmla"``, ``layout`` V4, no in-kernel RoPE) goes to
    :func:`nsa_backend.write_fp8_ds_mla_v4_cache` where :func:`store_route` says so; everything else to
    SGLang's kernel.
    """
    original = _ORIGINALS[(V4_MEMORY_POOL, "fused_store_cache")]
    is_v4 = type == "flashmla" and freqs_cis is None and str(getattr(layout, "value", layout)) == "v4"
    if not is_v4 or store_route(detect_arch(input.device)).target == NATIVE_PASS:
        return original(input, cache, indices, page_size=page_size, type=type, layout=layout, freqs_cis=freqs_cis)
    pages = _u8(cache)
    if pages.dim() == 2:
        pages = pages[:, : page_size * V4_TOKEN_BYTES].view(pages.shape[0], page_size, V4_TOKEN_BYTES)
    nsa_backend.write_fp8_ds_mla_v4_cache(input.to(torch.bfloat16), pages, indices)
    return None


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                             clean_logits=False, logits_dtype=torch.float32, indices=None):
    """``deep_gemm.fp8_fp4_paged_mqa_logits`` signature on :func:`nsa_backend.fp8_fp4_paged_mqa_logits`
    (which always writes ``-inf`` where a row cannot see a key, a valid result for both ``clean_logits``)."""
    if indices is not None:
        raise ValueError("indices: nsa-backend's fp8_fp4_paged_mqa_logits scores every key (indices=None), got a "
                         "tensor")
    return nsa_backend.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                                max_context_len, logits_dtype)


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=False, max_seqlen_k=0,
                       logits_dtype=torch.float32, schedule_meta=None):
    """``deep_gemm.fp8_fp4_mqa_logits`` signature on :func:`nsa_backend.fp8_fp4_mqa_logits` (``-inf``
    outside ``[ks, ke)`` for both ``clean_logits``; ``schedule_meta`` is DeepGEMM's and unused)."""
    return nsa_backend.fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                                          max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)


REPLACEMENTS: dict[tuple[str, str], Callable[..., Any]] = {
    (FLASH_MLA_INTERFACE, "flash_mla_with_kvcache"): flash_mla_with_kvcache,
    (FLASH_MLA_INTERFACE, "flash_mla_sparse_fwd"): flash_mla_sparse_fwd,
    (FLASH_MLA_INTERFACE, "get_mla_metadata"): get_mla_metadata,
    (FLASH_MLA_SM120, "flash_mla_with_kvcache_sm120"): flash_mla_with_kvcache_sm120,
    (V4_MEMORY_POOL, "fused_store_cache"): fused_store_cache,
}
"""``(SGLang module, attribute)`` -> replacement installed by :func:`activate`."""
DEEP_GEMM_V4_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "fp8_fp4_paged_mqa_logits": fp8_fp4_paged_mqa_logits,
    "fp8_fp4_mqa_logits": fp8_fp4_mqa_logits,
}
"""``deep_gemm`` functions of the V4 MXFP4 indexer, routed like :mod:`.kernels`' DeepGEMM functions."""

_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}
_lock = threading.Lock()
_active = False


def _substitute_flash_mla_interface(error: Exception) -> types.ModuleType:
    """A ``flash_mla_interface`` module for a machine where FlashMLA's library cannot load."""
    module = types.ModuleType(FLASH_MLA_INTERFACE, f"nsa-backend's DeepSeek-V4 functions (FlashMLA: {error})")
    for (name, attr), fn in REPLACEMENTS.items():
        if name == FLASH_MLA_INTERFACE:
            setattr(module, attr, fn)
    module.SPLIT_KV_MIN_TOPK = SPLIT_KV_MIN_TOPK
    setattr(module, _MARK, True)
    sys.modules[FLASH_MLA_INTERFACE] = module
    parent = importlib.import_module(FLASH_MLA_INTERFACE.rsplit(".", 1)[0])
    setattr(parent, FLASH_MLA_INTERFACE.rsplit(".", 1)[1], module)
    return module


def _install(module_name: str, replaced: list[str]) -> None:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # FlashMLA's CUDA library fails to load (no build for the machine, no driver)
        if module_name != FLASH_MLA_INTERFACE:
            raise
        logger.warning("nsa-backend: %s cannot be imported (%s); providing nsa-backend's DeepSeek-V4 functions "
                       "under its name", module_name, exc)
        _substitute_flash_mla_interface(exc)
        replaced.append(f"{module_name} (substitute module)")
        return
    for (name, attr), fn in REPLACEMENTS.items():
        if name != module_name:
            continue
        current = getattr(module, attr, None)
        if current is None or getattr(current, _MARK, False) or current is fn:
            continue
        _ORIGINALS[(name, attr)] = current
        setattr(module, attr, fn)
        replaced.append(f"{module_name}.{attr}")


def activate() -> list[str]:
    """Install the DeepSeek-V4 replacements in this process (idempotent); returns what was replaced.

    Must run before SGLang builds its ``dsv4`` backend (its ``__init__`` binds
    ``flash_mla_with_kvcache``); the plugin calls it from ``register()``.
    """
    global _active
    replaced: list[str] = []
    with _lock:
        if _active:
            return replaced
        for module_name in dict.fromkeys(name for name, _ in REPLACEMENTS):
            _install(module_name, replaced)
        replaced += _activate_deep_gemm_v4()
        _active = True
    logger.info("nsa-backend: DeepSeek-V4 attention routed per call (%s)", ", ".join(replaced) or "already")
    return replaced


def _activate_deep_gemm_v4() -> list[str]:
    """Point ``deep_gemm``'s MXFP4 indexer functions at nsa-backend, with :mod:`.kernels`' per-thread guard
    (a call nsa-backend routes back to DeepGEMM reaches the original function)."""
    try:
        deep_gemm = importlib.import_module("deep_gemm")
    except Exception as exc:  # an installed DeepGEMM can fail to load its CUDA library
        logger.warning("nsa-backend: deep_gemm not importable (%s); DeepSeek-V4 MXFP4 indexer calls not routed", exc)
        return []
    replaced = []
    for attr, fn in DEEP_GEMM_V4_FUNCTIONS.items():
        current = getattr(deep_gemm, attr, None)
        if current is None or getattr(current, kernels._MARK, False):
            continue
        _ORIGINALS[("deep_gemm", attr)] = current
        setattr(deep_gemm, attr, kernels._guarded(current, fn))
        replaced.append(f"deep_gemm.{attr}")
    return replaced


def active() -> bool:
    return _active


def deactivate() -> None:
    """Put SGLang's original functions back (tests)."""
    global _active
    with _lock:
        for (module_name, attr), original in _ORIGINALS.items():
            module = sys.modules.get(module_name)
            if module is not None:
                setattr(module, attr, original)
        _ORIGINALS.clear()
        module = sys.modules.get(FLASH_MLA_INTERFACE)
        if module is not None and getattr(module, _MARK, False):
            del sys.modules[FLASH_MLA_INTERFACE]
        _active = False
