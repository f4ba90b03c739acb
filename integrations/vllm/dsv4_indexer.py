"""MXFP4 indexer logits of vLLM's DeepSeek-V4 C4A layers on nsa-backend (imports vLLM lazily).

vLLM's DeepSeek-V4 indexer (``DeepseekV4Indexer``, an MXFP4 key cache on compressed C4A layers) runs
``vllm.model_executor.layers.sparse_attn_indexer.sparse_attn_indexer``, which calls DeepGEMM's
``fp8_fp4_mqa_logits`` (prefill chunks) and ``fp8_fp4_paged_mqa_logits`` (decode rows) through the
names that module imported from ``vllm.utils.deep_gemm``. The calls look those names up as module
globals when they run, so replacing the two attributes of that module reaches every call. DeepGEMM
has no such kernels on SM8x and serves only 32 / 64 indexer heads on SM120.

:func:`install` points the two names at :func:`fp8_fp4_mqa_logits` and
:func:`fp8_fp4_paged_mqa_logits` below: for MXFP4 keys they call :func:`nsa_backend.fp8_fp4_mqa_logits`
/ :func:`nsa_backend.fp8_fp4_paged_mqa_logits` (DeepGEMM's semantics, any head count 1..128). vLLM's FP8
indexer operands (its default indexer cache everywhere but SM10x: e4m3 queries without a scale, e4m3 keys
with fp32 per-key scales, in the paged form 132-byte rows) call :func:`nsa_backend.fp8_mqa_logits` /
:func:`nsa_backend.fp8_paged_mqa_logits`, DeepGEMM's FP8 kernels' semantics. Any other operands (SM10x's
UE8M0 int32 key scales, another row width) go to vLLM's function unchanged. ``dsv4`` installs them when it
selects :class:`NsaDeepseekV4Attention` for a layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

import nsa_backend
from nsa_backend.indexer import FP4_ROW_BYTES

INDEXER_LAYER = "vllm.model_executor.layers.sparse_attn_indexer"
_PACKED = (torch.int8, torch.uint8)
FP8_ROW_BYTES = 132   # vLLM's FP8 indexer row: 128 e4m3 values and one fp32 scale


def _fp8_keys(q: Any, keys: Any, scales: Any) -> bool:
    """Whether a ragged logits call carries vLLM's FP8 indexer operands (e4m3 q without a scale, e4m3 keys
    with fp32 per-key scales): DeepGEMM's ``fp8_mqa_logits``, which nsa-backend serves on every arch."""
    return (isinstance(keys, torch.Tensor) and keys.dtype == torch.float8_e4m3fn and isinstance(scales, torch.Tensor)
            and scales.dtype == torch.float32 and isinstance(q, (tuple, list)) and q[1] is None
            and isinstance(q[0], torch.Tensor) and q[0].dtype == torch.float8_e4m3fn)

# vLLM's functions the replacements stood in for: name -> function (empty while not installed).
_ORIGINALS: dict[str, Callable[..., torch.Tensor]] = {}


def _original(name: str) -> Callable[..., torch.Tensor]:
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    return getattr(importlib.import_module("vllm.utils.deep_gemm"), name)


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    max_seqlen_k: int,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """vLLM's ``fp8_fp4_mqa_logits`` (ragged prefill logits) with MXFP4 or FP8 keys on nsa-backend.

    Parameters
    ----------
    q : tuple
        ``(q_values, q_scale)``: packed MXFP4 ``int8 [M, H, 64]`` with ``int32 [M, H]`` UE8M0 x4
        scales (vLLM's FP4 path), or e4m3 ``[M, H, 128]`` with ``None``.
    kv : tuple
        ``(k_values, k_scales)``: packed MXFP4 ``int8 [N, 64]`` and ``int32 [N]`` scales, or e4m3
        ``[N, 128]`` keys with fp32 ``[N]`` scales (both routed to nsa-backend); e4m3 keys with int32
        (UE8M0) scales go to vLLM's function.
    weights : torch.Tensor
        ``[M, H]`` fp32 or bf16.
    cu_seqlen_ks, cu_seqlen_ke : torch.Tensor
        ``int32 [M]``: row ``i`` sees keys ``[ks[i], ke[i])``.
    max_seqlen_k : int
        Output columns; row ``i``'s column ``j`` is key ``ks[i] + j``.
    logits_dtype : torch.dtype
        fp32 or bf16 output.

    Returns
    -------
    torch.Tensor
        ``[M, max_seqlen_k]``; columns outside a row's window are ``-inf`` on the nsa-backend path.
    """
    keys = kv[0] if isinstance(kv, (tuple, list)) and len(kv) == 2 else None
    if _fp8_keys(q, keys, kv[1] if keys is not None else None):
        # vLLM's FP8 indexer cache (every arch but sm_10x): e4m3 keys with fp32 scales, DeepGEMM's fp8 kernel.
        out = nsa_backend.fp8_mqa_logits(q[0], (keys, kv[1]), weights.float(), cu_seqlen_ks, cu_seqlen_ke, True,
                                         max_seqlen_k)
        return out.to(logits_dtype)
    if not isinstance(keys, torch.Tensor) or keys.dtype not in _PACKED:
        # vLLM 0.33's function has no logits_dtype parameter: pass it only when it is not the default.
        extra = {} if logits_dtype == torch.float32 else {"logits_dtype": logits_dtype}
        return _original("fp8_fp4_mqa_logits")(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, **extra)
    return nsa_backend.fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, logits_dtype)


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    logits_dtype: torch.dtype = torch.float32,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's ``fp8_fp4_paged_mqa_logits`` (decode logits) with an MXFP4 or FP8 key cache on nsa-backend.

    Parameters
    ----------
    q : tuple
        ``(q_values, q_scale)``: packed MXFP4 ``int8 [B, next_n, H, 64]`` with ``int32 [B, next_n, H]``
        scales, or e4m3 ``[B, next_n, H, 128]`` with ``None``.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, block_size, 1, 68]`` (vLLM's ``kv_cache_as_quant_view``; the page stride may
        exceed the page) for MXFP4, or ``[num_blocks, block_size, 1, 132]`` for FP8 with e4m3 queries (both
        routed to nsa-backend); any other row width goes to vLLM's function.
    weights : torch.Tensor
        ``[B * next_n, H]`` fp32 or bf16.
    context_lens : torch.Tensor
        ``int32 [B, next_n]`` or ``[B]`` (see :func:`nsa_backend.fp8_fp4_paged_mqa_logits`).
    block_tables : torch.Tensor
        ``int32 [B, max_blocks]``.
    schedule_metadata : torch.Tensor
        DeepGEMM's schedule (accepted, not needed).
    max_model_len : int
        Output columns.
    logits_dtype : torch.dtype
        fp32 or bf16 output.
    indices : torch.Tensor, optional
        Request of each row in DeepGEMM's varlen form (``next_n`` 1). vLLM then passes a block table
        and a context length per row, so every row is its own batch entry and the map is not needed.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_model_len]``; keys a row cannot see are ``-inf`` on the nsa-backend path.
    """
    rows = kv_cache.shape[-1] if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8 else None
    fp8 = rows == FP8_ROW_BYTES and q[1] is None and q[0].dtype == torch.float8_e4m3fn
    if not fp8 and rows != FP4_ROW_BYTES:
        extra: dict[str, Any] = {} if logits_dtype == torch.float32 else {"logits_dtype": logits_dtype}
        return _original("fp8_fp4_paged_mqa_logits")(q, kv_cache, weights, context_lens, block_tables,
                                                     schedule_metadata, max_model_len, indices=indices, **extra)
    if indices is not None and block_tables.shape[0] != weights.shape[0]:
        raise ValueError(f"block_tables: the varlen form (indices given) needs one block-table row per query row "
                         f"({weights.shape[0]}), got {block_tables.shape[0]}")
    if fp8:
        # vLLM's FP8 indexer cache (every arch but SM10x): 128 e4m3 values and an fp32 scale per row.
        out = nsa_backend.fp8_paged_mqa_logits(q[0], kv_cache, weights.float(), context_lens, block_tables,
                                               schedule_metadata, max_model_len, True)
        return out.to(logits_dtype)
    return nsa_backend.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                                                max_model_len, logits_dtype)


REPLACEMENTS: dict[str, Callable[..., torch.Tensor]] = {
    "fp8_fp4_mqa_logits": fp8_fp4_mqa_logits,
    "fp8_fp4_paged_mqa_logits": fp8_fp4_paged_mqa_logits,
}


def install() -> list[str]:
    """Point vLLM's indexer-layer names at the replacements (idempotent); returns the replaced paths."""
    module = importlib.import_module(INDEXER_LAYER)
    for name, ours in REPLACEMENTS.items():
        current = getattr(module, name)
        if current is not ours:
            _ORIGINALS[name] = current
            setattr(module, name, ours)
    return [f"{INDEXER_LAYER}.{name}" for name in REPLACEMENTS]


def uninstall() -> None:
    """Restore vLLM's functions (no-op while not installed)."""
    module = importlib.import_module(INDEXER_LAYER)
    for name, original in list(_ORIGINALS.items()):
        if getattr(module, name) is REPLACEMENTS[name]:
            setattr(module, name, original)
        del _ORIGINALS[name]


def is_installed() -> bool:
    """Whether both of vLLM's indexer-layer names point at the replacements."""
    module = importlib.import_module(INDEXER_LAYER)
    return all(getattr(module, name) is ours for name, ours in REPLACEMENTS.items())
