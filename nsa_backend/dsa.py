"""The DSA attention pipeline on routed ops: indexer -> top-k -> sparse MLA.

These functions are what the SGLang and vLLM backends call once they have adapted their metadata
to :class:`~nsa_backend.metadata.SparseAttnMetadata`; they only chain the public ops (each routed
to the best implementation for the GPU) and index tensors, so they run on every arch and on CPU.

Caches: the indexer key cache is ``uint8 [num_blocks, page, 1, D + 4]`` (page-wise values then
scales); the attention cache is "fp8_ds_mla" ``uint8 [num_blocks, page, (1,) 656]`` or bf16
``[num_blocks, page, 1, d_qk]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_backend.indexer import fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata
from nsa_backend.metadata import SparseAttnMetadata
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
    """``[T_p, topk]`` int32 positions in the prefill key buffer (``PrefillBatch.key_slots``), -1: none."""


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
    T, H, D = q.shape
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    prefill_keys = None
    dec = md.decode
    if dec is not None and dec.num_reqs:
        rows = slice(0, dec.num_tokens)
        meta = dec.schedule_meta
        if meta is None:
            meta = get_paged_mqa_logits_metadata(dec.context_lens, md.page_size, num_sms, impl=impl)
        logits = fp8_paged_mqa_logits(q[rows].view(dec.num_reqs, dec.next_n, H, D), index_k_cache,
                                      weights[rows].contiguous(), dec.context_lens, dec.block_table, meta,
                                      dec.max_context_len, clean_logits=True, impl=impl)
        positions = topk_indices(logits, topk, ends=dec.context_lens.reshape(-1), impl=impl)
        out[rows] = logical_to_global_indices(positions, dec.block_table, dec.req_ids, md.page_size, impl=impl)
    pre = md.prefill
    if pre is not None and pre.num_tokens:
        rows = slice(pre.token_start, pre.token_start + pre.num_tokens)
        k, k_scale = gather_indexer_keys(index_k_cache, pre.key_slots, D)
        logits = fp8_mqa_logits(q[rows].contiguous(), (k, k_scale), weights[rows].contiguous(),
                                pre.cu_seq_len_k_start, pre.cu_seq_len_k_end, clean_logits=True, impl=impl)
        prefill_keys = topk_indices(logits, topk, pre.cu_seq_len_k_start, pre.cu_seq_len_k_end, impl=impl)
        valid = prefill_keys >= 0
        slots = pre.key_slots[prefill_keys.clamp(min=0).long()]
        out[rows] = torch.where(valid, slots.int(), torch.full_like(prefill_keys, -1))
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
    impl: str = "auto",
) -> torch.Tensor:
    """Sparse MLA over the selected keys: decode reads the paged cache, prefill a gathered bf16 copy.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, h_q, d_qk]`` ``bfloat16`` (absorbed latent queries: 512 latent + 64 rope).
    kv_cache : torch.Tensor
        Attention cache in ``kv_format`` ("fp8_ds_mla" or "bf16"), this step's tokens written.

    Returns
    -------
    torch.Tensor
        ``[T, h_q, d_v]`` ``bfloat16``.
    """
    T, h_q, d_qk = q.shape
    out = torch.zeros(T, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    dec = md.decode
    if dec is not None and dec.num_reqs:
        rows = slice(0, dec.num_tokens)
        idx = selection.global_slots[rows].view(dec.num_reqs, dec.next_n, -1)
        o, _ = sparse_mla_decode(q[rows].view(dec.num_reqs, dec.next_n, h_q, d_qk), kv_cache, idx, sm_scale,
                                 d_v, kv_format, attn_sink, impl=impl)
        out[rows] = o.view(dec.num_tokens, h_q, d_v)
    pre = md.prefill
    if pre is not None and pre.num_tokens:
        rows = slice(pre.token_start, pre.token_start + pre.num_tokens)
        kv = _gather_attention_kv(kv_cache, kv_format, pre.key_slots, md.page_size)
        o, _, _ = flash_mla_sparse_fwd(q[rows].contiguous(), kv, selection.prefill_keys[:, None, :], sm_scale,
                                       d_v, attn_sink, impl=impl)
        out[rows] = o
    return out


def _gather_attention_kv(kv_cache: torch.Tensor, kv_format: str, slots: torch.Tensor,
                         page_size: int) -> torch.Tensor:
    """bf16 ``[n, 1, d_qk]`` copy of the attention cache rows at ``slots``."""
    num_blocks = kv_cache.shape[0]
    rows = kv_cache.reshape(num_blocks, page_size, -1)[slots // page_size, slots % page_size]
    if kv_format == "fp8_ds_mla":
        rows = unpack_fp8_ds_mla(rows)
    return rows.unsqueeze(1).contiguous()
