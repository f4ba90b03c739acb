"""MXFP4 indexer logits of vLLM's DeepSeek-V4 C4A layers on nsa-backend (imports vLLM lazily).

vLLM's DeepSeek-V4 indexer (``DeepseekV4Indexer``, an MXFP4 key cache on compressed C4A layers) runs
``vllm.model_executor.layers.sparse_attn_indexer.sparse_attn_indexer``, which calls DeepGEMM's
``fp8_fp4_mqa_logits`` (prefill chunks) and ``fp8_fp4_paged_mqa_logits`` (decode rows) through the
names that module imported from ``vllm.utils.deep_gemm``. The calls look those names up as module
globals when they run, so replacing the two attributes of that module reaches every call. DeepGEMM
has no such kernels on SM8x and serves only 32 / 64 indexer heads on SM120.

:func:`install` points the two names at :func:`fp8_fp4_mqa_logits` and
:func:`fp8_fp4_paged_mqa_logits` below: for MXFP4 keys they call :func:`nsa_backend.fp8_fp4_mqa_logits`
/ :func:`nsa_backend.fp8_fp4_paged_mqa_logits` (DeepGEMM's semantics, any head count 1..128);
e4m3 keys (the FP8 indexer cache of other models sharing the module) go to vLLM's function
unchanged. ``dsv4`` installs them when it selects :class:`NsaDeepseekV4Attention` for a layer.
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
    """vLLM's ``fp8_fp4_mqa_logits`` (ragged prefill logits) with MXFP4 keys on nsa-backend.

    Parameters
    ----------
    q : tuple
        ``(q_values, q_scale)``: packed MXFP4 ``int8 [M, H, 64]`` with ``int32 [M, H]`` UE8M0 x4
        scales (vLLM's FP4 path), or e4m3 ``[M, H, 128]`` with ``None``.
    kv : tuple
        ``(k_values, k_scales)``: packed MXFP4 ``int8 [N, 64]`` and ``int32 [N]`` scales (routed to
        nsa-backend), or e4m3 keys with fp32 / int32 scales (routed to vLLM's function).
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
    """vLLM's ``fp8_fp4_paged_mqa_logits`` (decode logits) with an MXFP4 key cache on nsa-backend.

    Parameters
    ----------
    q : tuple
        ``(q_values, q_scale)``: packed MXFP4 ``int8 [B, next_n, H, 64]`` with ``int32 [B, next_n, H]``
        scales, or e4m3 ``[B, next_n, H, 128]`` with ``None``.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, block_size, 1, 68]`` (vLLM's ``kv_cache_as_quant_view``; the page stride may
        exceed the page) for MXFP4 (routed to nsa-backend); any other row width goes to vLLM's function.
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
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != FP4_ROW_BYTES:
        extra: dict[str, Any] = {} if logits_dtype == torch.float32 else {"logits_dtype": logits_dtype}
        return _original("fp8_fp4_paged_mqa_logits")(q, kv_cache, weights, context_lens, block_tables,
                                                     schedule_metadata, max_model_len, indices=indices, **extra)
    if indices is not None and block_tables.shape[0] != weights.shape[0]:
        raise ValueError(f"block_tables: the varlen form (indices given) needs one block-table row per query row "
                         f"({weights.shape[0]}), got {block_tables.shape[0]}")
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
