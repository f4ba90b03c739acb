"""The DSA lightning indexer of one vLLM layer on nsa-backend's routed ops (no vLLM import).

vLLM's indexer K cache is ``[num_blocks, page, D + 4]`` uint8 (``D`` = index head dim, 128;
``page`` = 64) with the page-wise layout DeepGEMM uses: the ``page * D`` e4m3 values of a block
first (token-major), then its ``page`` fp32 scales. Each token is quantised with one scale,
``amax / 448`` (``scale_fmt="ue8m0"``: rounded up to a power of two).

The indexer writes, for every token, the per-request positions of its ``index_topk`` highest
scoring keys into vLLM's shared ``topk_indices_buffer`` ``[max_tokens, >= index_topk]`` int32
(``-1``: fewer keys than ``index_topk``). The attention backend turns them into cache slots.
"""

from __future__ import annotations

from typing import Any

import torch

import nsa_backend

FP8_MAX = 448.0
SCALE_EPS = 1e-4


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


def gather_indexer_k(
    kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor, total: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of whole requests, concatenated: request ``r`` fills rows ``[cu_seq_lens[r], cu_seq_lens[r+1])``.

    Parameters
    ----------
    block_table : torch.Tensor
        ``[R, M]`` int32 blocks of the ``R`` requests.
    cu_seq_lens : torch.Tensor
        ``[R + 1]`` int32 prefix sums of the requests' key counts; ``total = cu_seq_lens[-1]``.

    Returns
    -------
    tuple
        ``(k [total, D] float8_e4m3fn, k_scale [total] float32)``.
    """
    page = kv_cache.shape[1]
    device = kv_cache.device
    rows = torch.arange(total, device=device, dtype=cu_seq_lens.dtype)
    req = torch.searchsorted(cu_seq_lens[1:].contiguous(), rows, right=True)
    pos = (rows - cu_seq_lens[req]).long()
    block = block_table[req, pos // page].long()
    offset = pos % page
    pages = _pages(kv_cache)
    cols = torch.arange(head_dim, device=device)
    values = pages[block[:, None], offset[:, None] * head_dim + cols[None, :]]
    scale_cols = torch.arange(4, device=device)
    scales = pages[block[:, None], page * head_dim + offset[:, None] * 4 + scale_cols[None, :]]
    return values.view(torch.float8_e4m3fn), scales.contiguous().view(torch.float32).view(-1)


def prefill_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: list[Any],
    topk_tokens: int,
    head_dim: int,
    topk_indices_buffer: torch.Tensor,
) -> None:
    """Top-k positions of the prefill tokens, chunk by chunk (``DeepseekV32IndexerPrefillChunkMetadata``).

    A chunk covers tokens ``[token_start, token_end)`` of some requests; its keys are gathered once
    (a chunk with ``skip_kv_gather`` reuses the previous chunk's keys). Row ``i`` scores keys
    ``[ks[i], ke[i])`` of the gathered keys, i.e. positions ``0 .. ke[i]-ks[i]-1`` of its request.
    """
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    for chunk in chunks:
        cu_seq_lens = (
            chunk.local_cu_seq_lens
            if getattr(chunk, "local_cu_seq_lens", None) is not None
            else chunk.cu_seq_lens
        )
        total = int(getattr(chunk, "local_total_seq_lens", 0) or chunk.total_seq_lens)
        if not (getattr(chunk, "skip_kv_gather", False) and keys is not None):
            keys = (
                gather_indexer_k(kv_cache, chunk.block_table, cu_seq_lens, total, head_dim) if total else None
            )
        rows = slice(chunk.token_start, chunk.token_end)
        out = topk_indices_buffer[rows, :topk_tokens]
        if keys is None or chunk.token_end <= chunk.token_start:
            out.fill_(-1)
            continue
        ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
        width = max(int(chunk.max_seqlen_k), 1)
        logits = nsa_backend.fp8_mqa_logits(
            q_fp8[rows].contiguous(),
            keys,
            weights[rows].float().contiguous(),
            ks,
            ke,
            clean_logits=False,
            max_seqlen_k=width,
        )
        out.copy_(nsa_backend.topk_indices(logits, topk_tokens, ends=(ke - ks).to(torch.int32)))


def decode_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: Any,
    num_decode_tokens: int,
    max_model_len: int,
    topk_tokens: int,
    topk_indices_buffer: torch.Tensor,
) -> None:
    """Top-k positions of the decode tokens (``DeepSeekV32IndexerDecodeMetadata``).

    Decode requests carry ``next_n`` query tokens each (1, or more with speculative decoding). A
    batch whose requests have different query lengths is padded to ``[B, max_len]`` first, each
    request's tokens in its last rows.
    ``decode.seq_lens`` is ``[B, next_n]`` (visible keys of each query row) or ``[B]`` / ``[B, 1]``
    (context length ``L``: row ``j`` sees positions ``<= L - next_n + j``).
    """
    decode_lens = decode.decode_lens
    batch = decode_lens.shape[0]
    if num_decode_tokens == 0 or batch == 0:
        return
    q = q_fp8[:num_decode_tokens]
    w = weights[:num_decode_tokens].float()
    padded = bool(decode.requires_padding) or num_decode_tokens % batch != 0
    if padded:
        lens = decode_lens.tolist()
        next_n = max(lens)
        starts = torch.tensor([0, *lens], device=q.device).cumsum(0)[:-1]
        token_req = torch.repeat_interleave(torch.arange(batch, device=q.device), decode_lens.long())
        # Right-aligned: row j of request b sees L_b - next_n + j + 1 keys, so a request with fewer
        # than next_n tokens takes the last rows.
        token_col = (
            torch.arange(num_decode_tokens, device=q.device)
            - starts[token_req]
            + (next_n - decode_lens.to(q.device).long())[token_req]
        )
        dest = token_req * next_n + token_col
        q4 = torch.zeros((batch * next_n, *q.shape[1:]), dtype=torch.uint8, device=q.device)
        q4[dest] = q.view(torch.uint8)
        q4 = q4.view(q.dtype).view(batch, next_n, *q.shape[1:])
        w4 = w.new_zeros((batch * next_n, w.shape[1]))
        w4[dest] = w
    else:
        next_n = num_decode_tokens // batch
        q4, w4, dest = q.reshape(batch, next_n, *q.shape[1:]), w, None

    seq_lens = decode.seq_lens[:batch]
    if seq_lens.dim() == 2 and seq_lens.shape[1] != next_n:
        if seq_lens.shape[1] != 1:
            raise ValueError(
                f"decode seq_lens {tuple(seq_lens.shape)} does not match {next_n} query rows per request"
            )
        seq_lens = seq_lens[:, 0]
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if seq_lens.dim() == 2:
        visible = seq_lens.reshape(-1)
    else:
        j = torch.arange(next_n, device=seq_lens.device, dtype=torch.int32)
        visible = (seq_lens[:, None] - next_n + j[None, :] + 1).clamp(min=0).reshape(-1)
    cache = kv_cache if kv_cache.dim() == 4 else kv_cache.unsqueeze(2)
    schedule = getattr(decode, "schedule_metadata", None)
    if schedule is None or schedule.dim() != 2 or schedule.shape[-1] != 2:
        num_sms = (
            torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 1
        )
        schedule = nsa_backend.get_paged_mqa_logits_metadata(seq_lens, cache.shape[1], num_sms)
    logits = nsa_backend.fp8_paged_mqa_logits(
        q4.contiguous(),
        cache,
        w4.contiguous(),
        seq_lens,
        decode.block_table[:batch].to(torch.int32),
        schedule,
        max_model_len,
        clean_logits=False,
    )
    top = nsa_backend.topk_indices(logits, topk_tokens, ends=visible.to(torch.int32))
    if dest is not None:
        top = top[dest]
    topk_indices_buffer[:num_decode_tokens, :topk_tokens] = top


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

    Returns
    -------
    torch.Tensor
        ``topk_indices_buffer``, rows ``[0, T)`` written.
    """
    if insert_k:
        if k is None:
            raise ValueError("the indexer K cache insert needs k")
        slot_mapping = metadata.slot_mapping
        insert_indexer_k(k[: slot_mapping.shape[0]], kv_cache, slot_mapping, scale_fmt)
    if clear_buffer:
        topk_indices_buffer[: q_fp8.shape[0]] = -1
    if metadata.num_prefills > 0:
        prefill_topk(
            q_fp8, weights, kv_cache, metadata.prefill.chunks, topk_tokens, head_dim, topk_indices_buffer
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
        )
    return topk_indices_buffer
