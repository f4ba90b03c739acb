"""The DSA lightning indexer of one vLLM layer on nsa-backend's routed ops (no vLLM import).

vLLM's indexer K cache is ``[num_blocks, page, D + 4]`` uint8 (``D`` = index head dim, 128;
``page`` = 64) with the page-wise layout DeepGEMM uses: the ``page * D`` e4m3 values of a block
first (token-major), then its ``page`` fp32 scales. Each token is quantised with one scale,
``amax / 448`` (``scale_fmt="ue8m0"``: rounded up to a power of two).

The indexer writes, for every token, the per-request positions of its ``index_topk`` highest
scoring keys into vLLM's shared ``topk_indices_buffer`` ``[max_tokens, >= index_topk]`` int32
(``-1``: fewer keys than ``index_topk``). The attention backend turns them into cache slots.

vLLM's indexer metadata (``DeepseekV32IndexerMetadata``) is adapted to nsa-backend's
:class:`~nsa_backend.metadata.DecodeBatch` (its decode part) and one
:class:`~nsa_backend.metadata.PrefillBatch` per prefill chunk; the scores and top-k are
:func:`nsa_backend.dsa.decode_topk_positions` and :func:`nsa_backend.dsa.prefill_topk_positions`,
ranked in vLLM's ``logits_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch

from nsa_backend.dsa import LOGITS_DTYPES, decode_topk_positions, gather_indexer_keys, prefill_topk_positions
from nsa_backend.metadata import DecodeBatch, PrefillBatch, request_key_slots

FP8_MAX = 448.0
SCALE_EPS = 1e-4
def check_logits_dtype(logits_dtype: Any) -> torch.dtype:
    """``logits_dtype`` when the index scores can be produced in it; ``ValueError`` naming it otherwise."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(
            f"nsa-backend indexer: logits_dtype={logits_dtype!r} is not supported; expected one of "
            f"{[str(d) for d in LOGITS_DTYPES]} (vLLM's attention_config.indexer_logits_dtype)"
        )
    return logits_dtype


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page * (D + 4)]`` uint8 view of the indexer cache (blocks may be spaced)."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError(f"indexer cache: expected contiguous pages, got strides {tuple(kv_cache.stride())}")
    return kv_cache.flatten(1)


def insert_indexer_k(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_fmt: str | None
) -> None:
    """Quantise ``k`` ``[T, D]`` per token and write it into the cache slots ``slot_mapping`` ``[T]``.

    Negative slots are skipped. ``scale_fmt="ue8m0"`` rounds each scale up to a power of two.
    """
    page = kv_cache.shape[1]
    head_dim = k.shape[-1]
    if kv_cache.shape[-1] != head_dim + 4:
        raise NotImplementedError(
            f"indexer cache rows of {kv_cache.shape[-1]} bytes: expected one fp32 scale per "
            f"token ({head_dim} + 4 bytes)"
        )
    slots = slot_mapping[: k.shape[0]].long()
    keep = slots >= 0
    slots, kf = slots[keep], k[keep].float()
    scale = kf.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (kf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    pages = _pages(kv_cache)
    block, offset = slots // page, slots % page
    cols = torch.arange(head_dim, device=k.device)
    pages[block[:, None], offset[:, None] * head_dim + cols[None, :]] = values
    scale_cols = torch.arange(4, device=k.device)
    scale_bytes = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)
    pages[block[:, None], page * head_dim + offset[:, None] * 4 + scale_cols[None, :]] = scale_bytes


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def chunk_prefill_batch(chunk: Any, page_size: int) -> PrefillBatch:
    """:class:`PrefillBatch` of a ``DeepseekV32IndexerPrefillChunkMetadata``.

    The chunk's key buffer holds the whole keys of its requests (``cu_seq_lens``, or
    ``local_cu_seq_lens`` where set); ``cu_seqlen_ks`` / ``cu_seqlen_ke`` are each token's window in it.
    """
    cu_seq_lens = (
        chunk.local_cu_seq_lens if getattr(chunk, "local_cu_seq_lens", None) is not None else chunk.cu_seq_lens
    )
    total = int(getattr(chunk, "local_total_seq_lens", 0) or chunk.total_seq_lens)
    return PrefillBatch(
        token_start=int(chunk.token_start),
        num_tokens=max(int(chunk.token_end) - int(chunk.token_start), 0),
        key_slots=request_key_slots(chunk.block_table, cu_seq_lens, page_size, total),
        cu_seq_len_k_start=chunk.cu_seqlen_ks,
        cu_seq_len_k_end=chunk.cu_seqlen_ke,
    )


def prefill_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: list[Any],
    topk_tokens: int,
    head_dim: int,
    topk_indices_buffer: torch.Tensor,
    logits_dtype: torch.dtype = torch.float32,
) -> None:
    """Top-k positions of the prefill tokens, chunk by chunk (``DeepseekV32IndexerPrefillChunkMetadata``).

    A chunk covers tokens ``[token_start, token_end)`` of some requests; its keys are gathered once
    (a chunk with ``skip_kv_gather`` reuses the previous chunk's keys). Row ``i`` scores keys
    ``[ks[i], ke[i])`` of the gathered keys, i.e. positions ``0 .. ke[i]-ks[i]-1`` of its request.
    """
    page = kv_cache.shape[1]
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    w = weights.float()
    for chunk in chunks:
        pre = chunk_prefill_batch(chunk, page)
        if not (getattr(chunk, "skip_kv_gather", False) and keys is not None):
            keys = gather_indexer_keys(kv_cache, pre.key_slots, head_dim) if pre.key_slots.numel() else None
        out = topk_indices_buffer[pre.token_start : pre.token_start + pre.num_tokens, :topk_tokens]
        if keys is None or pre.num_tokens == 0:
            out.fill_(-1)
            continue
        width = max(int(chunk.max_seqlen_k), 1)
        out.copy_(prefill_topk_positions(pre, q_fp8, w, kv_cache, topk_tokens, keys=keys, max_seqlen_k=width,
                                         logits_dtype=logits_dtype))


def decode_batch(decode: Any, num_decode_tokens: int, max_model_len: int) -> DecodeBatch:
    """:class:`DecodeBatch` of a ``DeepSeekV32IndexerDecodeMetadata`` (no host sync).

    ``decode.block_table`` has one row per decode request (or per token, when vLLM flattened them)
    and ``decode.seq_lens`` is ``[B, next_n]`` (visible keys of each query row) or ``[B]`` /
    ``[B, 1]`` (context length ``L``: row ``j`` sees positions ``<= L - next_n + j``). A batch whose
    requests have different query lengths (``requires_padding``) becomes one row per token; a
    request's tokens are its last query rows.
    """
    batch = decode.decode_lens.shape[0]
    device = decode.block_table.device
    seq_lens = decode.seq_lens[:batch].to(torch.int32)
    if seq_lens.dim() == 2 and seq_lens.shape[1] == 1:
        seq_lens = seq_lens[:, 0]
    padded = bool(decode.requires_padding) or num_decode_tokens % batch != 0
    if not padded:
        next_n = num_decode_tokens // batch
        req_ids = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(next_n)
        if seq_lens.dim() == 2:
            if seq_lens.shape[1] != next_n:
                raise ValueError(
                    f"decode seq_lens {tuple(seq_lens.shape)} does not match {next_n} query rows per request"
                )
            context_lens = seq_lens.contiguous()
        else:
            j = torch.arange(next_n, device=device, dtype=torch.int32)
            context_lens = (seq_lens[:, None] - next_n + j[None, :] + 1).clamp(min=0)
        schedule = getattr(decode, "schedule_metadata", None)
        if schedule is None or schedule.dim() != 2 or schedule.shape[-1] != 2:
            schedule = None
    else:
        decode_lens = decode.decode_lens.to(device=device, dtype=torch.int64)
        req = torch.repeat_interleave(
            torch.arange(batch, device=device), decode_lens, output_size=num_decode_tokens
        )
        starts = torch.cumsum(decode_lens, 0) - decode_lens
        local = torch.arange(num_decode_tokens, device=device) - starts[req]
        if seq_lens.dim() == 2:  # right-aligned rows of [B, next_n]
            visible = seq_lens[req, seq_lens.shape[1] - decode_lens[req] + local]
        else:
            visible = (seq_lens.long()[req] - decode_lens[req] + local + 1).clamp(min=0)
        next_n, req_ids, schedule = 1, req.to(torch.int32), None
        context_lens = visible.to(torch.int32).view(-1, 1)
    return DecodeBatch(
        num_reqs=num_decode_tokens // next_n,
        next_n=next_n,
        context_lens=context_lens,
        block_table=decode.block_table[:batch].to(torch.int32),
        req_ids=req_ids,
        max_context_len=max_model_len,
        schedule_meta=schedule,
    )


def decode_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: Any,
    num_decode_tokens: int,
    max_model_len: int,
    topk_tokens: int,
    topk_indices_buffer: torch.Tensor,
    logits_dtype: torch.dtype = torch.float32,
) -> None:
    """Top-k positions of the decode tokens (``DeepSeekV32IndexerDecodeMetadata``, see :func:`decode_batch`)."""
    if num_decode_tokens == 0 or decode.decode_lens.shape[0] == 0:
        return
    dec = decode_batch(decode, num_decode_tokens, max_model_len)
    cache = kv_cache if kv_cache.dim() == 4 else kv_cache.unsqueeze(2)
    topk_indices_buffer[:num_decode_tokens, :topk_tokens] = decode_topk_positions(
        dec, q_fp8, weights[:num_decode_tokens].float(), cache, topk_tokens, num_sms=_num_sms(q_fp8.device),
        logits_dtype=logits_dtype,
    )


def run_indexer(
    metadata: Any,
    kv_cache: torch.Tensor,
    q_fp8: torch.Tensor,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    *,
    scale_fmt: str | None,
    topk_tokens: int,
    head_dim: int,
    max_model_len: int,
    topk_indices_buffer: torch.Tensor,
    insert_k: bool,
    clear_buffer: bool = True,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Indexer of one layer for a batch described by vLLM's ``DeepseekV32IndexerMetadata``.

    Parameters
    ----------
    q_fp8 : torch.Tensor
        ``[T, H, D]`` e4m3 index queries; the per-token q scale is folded into ``weights``.
    k : torch.Tensor, optional
        ``[T, D]`` index keys of this step's tokens, written to the cache when ``insert_k``.
    weights : torch.Tensor
        ``[T, H]`` per-head weights.
    logits_dtype : torch.dtype
        Dtype the index scores are produced in before the top-k (:data:`LOGITS_DTYPES`).

    Returns
    -------
    torch.Tensor
        ``topk_indices_buffer``, rows ``[0, T)`` written.
    """
    check_logits_dtype(logits_dtype)
    if insert_k:
        if k is None:
            raise ValueError("the indexer K cache insert needs k")
        slot_mapping = metadata.slot_mapping
        insert_indexer_k(k[: slot_mapping.shape[0]], kv_cache, slot_mapping, scale_fmt)
    if clear_buffer:
        topk_indices_buffer[: q_fp8.shape[0]] = -1
    if metadata.num_prefills > 0:
        prefill_topk(
            q_fp8, weights, kv_cache, metadata.prefill.chunks, topk_tokens, head_dim, topk_indices_buffer,
            logits_dtype,
        )
    if metadata.num_decodes > 0:
        decode_topk(
            q_fp8,
            weights,
            kv_cache,
            metadata.decode,
            metadata.num_decode_tokens,
            max_model_len,
            topk_tokens,
            topk_indices_buffer,
            logits_dtype,
        )
    return topk_indices_buffer
