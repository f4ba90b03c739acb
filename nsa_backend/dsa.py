"""The DSA attention pipeline on routed ops: indexer -> top-k -> sparse MLA.

These functions are what the SGLang and vLLM backends call once they have adapted their metadata
to :class:`~nsa_backend.metadata.SparseAttnMetadata`; they only chain the public ops (each routed
to the best implementation for the GPU) and index tensors, so they run on every arch and on CPU.

Caches: the indexer key cache is ``uint8 [num_blocks, page, 1, D + 4]`` (page-wise values then
scales); the attention cache is "fp8_ds_mla" ``uint8 [num_blocks, page, (1,) 656]`` or bf16
``[num_blocks, page, 1, d_qk]``. Blocks may lie further apart than ``page`` rows (a padded
``stride(0)``, e.g. when layers share pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_backend.indexer import fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata
from nsa_backend.metadata import DecodeBatch, PrefillBatch, SparseAttnMetadata
from nsa_backend.quant import unpack_fp8_ds_mla
from nsa_backend.sparse_mla import flash_mla_sparse_fwd, sparse_mla_decode
from nsa_backend.topk import logical_to_global_indices, topk_indices

# Workers of the paged-logits schedule when the caller does not give one.
DEFAULT_NUM_SMS = 132


@dataclass
class TopkSelection:
    """Selected keys of every query token of a batch."""

    global_slots: torch.Tensor
    """``[T, topk]`` int32 cache slots (-1: none), for every token (decode and prefill)."""
    prefill_keys: torch.Tensor | None
    """``[T_p, topk]`` int32 positions in the prefill key buffer (``PrefillBatch.key_slots``), -1: none.
    ``None``: prefill tokens read their selected keys straight from the cache by ``global_slots``."""


def gather_indexer_keys(index_k_cache: torch.Tensor, slots: torch.Tensor,
                        head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read keys and scales of the given slots from a page-wise indexer cache.

    Returns ``(k [n, D] float8_e4m3fn, k_scale [n] float32)``.
    """
    P, page = index_k_cache.shape[0], index_k_cache.shape[1]
    flat = index_k_cache.reshape(P, -1)
    page_ids, rows = slots // page, slots % page
    cols = rows[:, None] * head_dim + torch.arange(head_dim, device=slots.device)[None, :]
    k = flat[page_ids[:, None], cols].view(torch.float8_e4m3fn)
    scale_cols = page * head_dim + rows[:, None] * 4 + torch.arange(4, device=slots.device)[None, :]
    k_scale = flat[page_ids[:, None], scale_cols].contiguous().view(torch.float32).view(-1)
    return k.contiguous(), k_scale


# Dtypes the index scores may be ranked in (vLLM's ``attention_config.indexer_logits_dtype``).
LOGITS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def in_logits_dtype(logits: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    """fp32 scores rounded to ``logits_dtype`` and held in fp32 for the top-k (-inf stays -inf).

    A framework that emits its scores in bf16 ranks those: rounding here selects the same keys
    (bf16 scores tie where fp32 ones differ). ``ValueError`` for a dtype not in :data:`LOGITS_DTYPES`.
    """
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype: expected one of {[str(d) for d in LOGITS_DTYPES]}, got {logits_dtype!r}")
    if logits_dtype == torch.float32:
        return logits
    return logits.to(logits_dtype).to(torch.float32)


def decode_topk_positions(
    dec: DecodeBatch,
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    topk: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    logits_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """Paged indexer + top-k of the decode tokens (rows ``[0, dec.num_tokens)`` of ``q`` / ``weights``).

    The scores are ranked as ``logits_dtype`` values (see :func:`in_logits_dtype`). Returns
    ``[dec.num_tokens, topk]`` int32 key positions inside each token's request, -1: none.
    """
    H, D = q.shape[1], q.shape[2]
    rows = slice(0, dec.num_tokens)
    meta = dec.schedule_meta
    if meta is None:
        meta = get_paged_mqa_logits_metadata(dec.context_lens, index_k_cache.shape[1], num_sms, impl=impl)
    logits = fp8_paged_mqa_logits(q[rows].reshape(dec.num_reqs, dec.next_n, H, D), index_k_cache,
                                  weights[rows].contiguous(), dec.context_lens, dec.row_block_table(),
                                  meta, dec.max_context_len, clean_logits=True, impl=impl)
    return topk_indices(in_logits_dtype(logits, logits_dtype), topk, ends=dec.context_lens.reshape(-1), impl=impl)


def prefill_topk_positions(
    pre: PrefillBatch,
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    topk: int,
    *,
    keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """Ragged indexer + top-k of the prefill tokens (rows ``pre.token_start ..`` of ``q`` / ``weights``).

    Parameters
    ----------
    keys : tuple of torch.Tensor, optional
        ``(k, k_scale)`` of ``pre.key_slots`` when already gathered (:func:`gather_indexer_keys`).
    max_seqlen_k : int
        When > 0, an upper bound of ``cu_seq_len_k_end - cu_seq_len_k_start``: the logits are kept
        in ``[T_p, max_seqlen_k]`` (each row from its own window start) instead of ``[T_p, K_total]``.
    logits_dtype : torch.dtype
        The scores are ranked as values of this dtype (see :func:`in_logits_dtype`).

    Returns
    -------
    torch.Tensor
        ``[T_p, topk]`` int32 key positions inside each token's request (offsets from
        ``cu_seq_len_k_start``), -1: none.
    """
    rows = slice(pre.token_start, pre.token_start + pre.num_tokens)
    if keys is None:
        keys = gather_indexer_keys(index_k_cache, pre.key_slots, q.shape[2])
    ks, ke = pre.cu_seq_len_k_start, pre.cu_seq_len_k_end
    logits = fp8_mqa_logits(q[rows].contiguous(), keys, weights[rows].contiguous(), ks, ke,
                            clean_logits=True, max_seqlen_k=max_seqlen_k, impl=impl)
    logits = in_logits_dtype(logits, logits_dtype)
    if max_seqlen_k > 0:
        return topk_indices(logits, topk, ends=ke - ks, impl=impl)
    chosen = topk_indices(logits, topk, ks, ke, impl=impl)
    return torch.where(chosen >= 0, chosen - ks[:, None], chosen)


def dsa_topk(
    md: SparseAttnMetadata,
    q: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    topk: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    impl: str = "auto",
) -> TopkSelection:
    """Lightning indexer + top-k for a batch.

    Parameters
    ----------
    md : SparseAttnMetadata
    q : torch.Tensor
        ``[T, H, D]`` ``float8_e4m3fn`` indexer queries.
    weights : torch.Tensor
        ``[T, H]`` ``float32`` head weights (q scale and softmax scale folded in).
    index_k_cache : torch.Tensor
        ``uint8 [num_blocks, page, 1, D + 4]`` indexer key cache, this step's keys already written.
    topk : int
        Keys per query token (2048 for current DSA models).
    """
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    prefill_keys = None
    dec = md.decode
    if dec is not None and dec.num_reqs:
        positions = decode_topk_positions(dec, q, weights, index_k_cache, topk, num_sms=num_sms, impl=impl)
        out[: dec.num_tokens] = logical_to_global_indices(positions, dec.block_table, dec.req_ids, md.page_size,
                                                          impl=impl)
    pre = md.prefill
    if pre is not None and pre.num_tokens:
        positions = prefill_topk_positions(pre, q, weights, index_k_cache, topk, impl=impl)
        valid = positions >= 0
        prefill_keys = torch.where(valid, positions + pre.cu_seq_len_k_start[:, None], positions)
        slots = pre.key_slots[prefill_keys.clamp(min=0).long()]
        out[pre.token_start : pre.token_start + pre.num_tokens] = torch.where(
            valid, slots.int(), torch.full_like(prefill_keys, -1))
    return TopkSelection(global_slots=out, prefill_keys=prefill_keys)


def dsa_sparse_attention(
    md: SparseAttnMetadata,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: TopkSelection,
    sm_scale: float,
    *,
    kv_format: str = "fp8_ds_mla",
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    kv_scale_format: str | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Sparse MLA over the selected keys: decode reads the paged cache, prefill bf16 key rows.

    Prefill keys are the gathered key buffer (``PrefillBatch.key_slots``) indexed by
    ``selection.prefill_keys``, or, when that is ``None``, the cache rows of
    ``selection.global_slots`` (a bf16 cache in place, fp8_ds_mla rows dequantised once each).

    Parameters
    ----------
    q : torch.Tensor
        ``[T, h_q, d_qk]`` ``bfloat16`` (absorbed latent queries: 512 latent + 64 rope).
    kv_cache : torch.Tensor
        Attention cache in ``kv_format`` ("fp8_ds_mla" or "bf16"), this step's tokens written.
    kv_scale_format : str, optional
        The scale format the fp8_ds_mla cache was written with (``"pow2"`` / ``"arbitrary"``), passed to
        :func:`nsa_backend.sparse_mla_decode`.

    Returns
    -------
    torch.Tensor
        ``[T, h_q, d_v]`` ``bfloat16``.
    """
    T, h_q, d_qk = q.shape
    parts: list[tuple[slice, torch.Tensor]] = []  # (token rows, their output)
    dec = md.decode
    if dec is not None and dec.num_reqs:
        rows = slice(0, dec.num_tokens)
        idx = selection.global_slots[rows].view(dec.num_reqs, dec.next_n, -1)
        q_dec = q[rows].reshape(dec.num_reqs, dec.next_n, h_q, d_qk)
        o, _ = sparse_mla_decode(q_dec, kv_cache, idx, sm_scale, d_v, kv_format, attn_sink,
                                 kv_scale_format=kv_scale_format, impl=impl)
        parts.append((rows, o.view(dec.num_tokens, h_q, d_v)))
    pre = md.prefill
    if pre is not None and pre.num_tokens:
        rows = slice(pre.token_start, pre.token_start + pre.num_tokens)
        if selection.prefill_keys is None:
            kv, keys = selected_cache_rows(kv_cache, kv_format, selection.global_slots[rows])
        else:
            kv = _gather_attention_kv(kv_cache, kv_format, pre.key_slots, md.page_size)
            keys = selection.prefill_keys
        o, _, _ = flash_mla_sparse_fwd(q[rows].contiguous(), kv, keys[:, None, :], sm_scale,
                                       d_v, attn_sink, impl=impl)
        parts.append((rows, o))
    if len(parts) == 1 and parts[0][1].shape[0] == T:
        return parts[0][1]  # one phase covers the batch (every pure decode step): no extra copy
    out = torch.zeros(T, h_q, d_v, dtype=torch.bfloat16, device=q.device)  # rows of no phase stay 0
    for rows, o in parts:
        out[rows] = o
    return out


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[num_rows, width]`` view of a ``[num_blocks, page, (1,) width]`` cache and its rows per block.

    The row of slot ``s`` is ``(s // page) * stride_rows + s % page``; rows between spaced blocks
    (other layers' pages) are never addressed.
    """
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    num_blocks, page, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) % width:
        raise ValueError(
            f"kv cache: expected contiguous rows of {width} elements, got strides {tuple(kv_cache.stride())}"
        )
    stride_rows = kv_cache.stride(0) // width
    num_rows = max(num_blocks - 1, 0) * stride_rows + page
    return kv_cache.as_strided((num_rows, width), (width, 1)), stride_rows


def selected_cache_rows(kv_cache: torch.Tensor, kv_format: str,
                        slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 keys for the valid entries of ``slots`` ``[R, K]`` (cache slots, -1: none).

    Returns ``(kv [U, 1, d_qk] bf16, indices [R, K] int32 into kv, -1 kept)``: a bf16 cache is used
    in place (indices are row numbers), fp8_ds_mla rows are dequantised once per distinct slot.
    """
    table, stride_rows = cache_rows(kv_cache)
    page = kv_cache.shape[1]
    valid = slots >= 0
    s = slots.long().clamp(min=0)
    rows = torch.where(valid, (s // page) * stride_rows + s % page, -1)
    if kv_format != "fp8_ds_mla":
        return table.unsqueeze(1), rows.to(torch.int32)
    unique_rows, inverse = torch.unique(rows[valid], return_inverse=True)
    if unique_rows.numel() == 0:  # nothing selected: one unused row keeps the shapes valid
        unique_rows = torch.zeros(1, dtype=unique_rows.dtype, device=unique_rows.device)
    kv = unpack_fp8_ds_mla(table[unique_rows].contiguous())
    local = torch.full_like(rows, -1)
    local[valid] = inverse
    return kv.unsqueeze(1), local.to(torch.int32)


def _gather_attention_kv(kv_cache: torch.Tensor, kv_format: str, slots: torch.Tensor,
                         page_size: int) -> torch.Tensor:
    """bf16 ``[n, 1, d_qk]`` copy of the attention cache rows at ``slots``."""
    num_blocks = kv_cache.shape[0]
    rows = kv_cache.reshape(num_blocks, page_size, -1)[slots // page_size, slots % page_size]
    if kv_format == "fp8_ds_mla":
        rows = unpack_fp8_ds_mla(rows)
    return rows.unsqueeze(1).contiguous()
