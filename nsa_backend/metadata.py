"""One framework-independent description of a DSA attention batch.

SGLang's ``DSAMetadata`` / ``DSAIndexerMetadata`` and vLLM's ``CommonAttentionMetadata`` /
``DeepseekV32IndexerMetadata`` are adapted to :class:`SparseAttnMetadata` by the integrations;
:mod:`nsa_backend.dsa` runs the indexer, top-k and sparse MLA from it.

Token order: the decode tokens come first, then the prefill (extend) tokens. Decode requests
have the same number ``next_n`` of query tokens (1, or 1 + draft tokens with MTP); a batch whose
decode query lengths differ (or are known only on the device) is described one query token per
decode row (``next_n = 1``, ``req_ids`` naming each token's request). A key position ``p`` of
request ``r`` lives in cache slot ``block_table[r, p // page_size] * page_size + p % page_size``.

:func:`build_sparse_attn_metadata` builds the whole description from host-side lengths;
:func:`token_request_ids`, :func:`build_decode_batch`, :func:`build_prefill_batch` and
:func:`request_key_slots` build its parts on the device without a host sync (optionally into
persistent buffers, for CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeBatch:
    """Requests whose query tokens read keys straight from the paged caches."""

    num_reqs: int
    """Number of decode requests ``B_d``."""
    next_n: int
    """Query tokens per decode request."""
    context_lens: torch.Tensor
    """``[B_d, next_n]`` int32: keys visible to each query row (its position + 1)."""
    block_table: torch.Tensor
    """``[R, max_blocks]`` int32 page ids, ``R >= 1``: the decode requests' rows (``R = B_d``) or
    the whole batch's table; rows are addressed through ``req_ids``."""
    req_ids: torch.Tensor
    """``[B_d * next_n]`` int32: row of ``block_table`` for each decode query token (the tokens of
    one decode row share their request)."""
    max_context_len: int
    """Upper bound of ``context_lens`` (columns of the paged logits)."""
    schedule_meta: torch.Tensor | None = None
    """``[num_sms + 1, 2]`` int32 paged-logits schedule, built on first use when ``None``."""

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.next_n

    def row_block_table(self) -> torch.Tensor:
        """``[B_d, max_blocks]`` int32: the page ids of each decode row's request."""
        rows = self.req_ids.view(self.num_reqs, self.next_n)[:, 0].long()
        return self.block_table.index_select(0, rows)


@dataclass
class PrefillBatch:
    """Requests whose keys are gathered into one contiguous buffer for the ragged indexer."""

    token_start: int
    """First prefill query token in the batch (= decode tokens before it)."""
    num_tokens: int
    """Number of prefill query tokens ``T_p``."""
    key_slots: torch.Tensor
    """``[K_total]`` int64: cache slot of every key of every prefill request, request after request."""
    cu_seq_len_k_start: torch.Tensor
    """``[T_p]`` int32: first key of each query token's request in ``key_slots``."""
    cu_seq_len_k_end: torch.Tensor
    """``[T_p]`` int32: one past the last key each query token may see (causal)."""


@dataclass
class SparseAttnMetadata:
    """A DSA batch: where new tokens go and which keys every query token may see."""

    page_size: int
    """Tokens per KV-cache page (64)."""
    num_tokens: int
    """Query tokens in the batch, decode tokens first."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` int64: cache slot each new token is written to (negative: skip)."""
    decode: DecodeBatch | None = None
    prefill: PrefillBatch | None = None


def token_request_ids(
    query_start_loc: torch.Tensor, num_tokens: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Request of each token, computed on ``query_start_loc``'s device without a host sync.

    Parameters
    ----------
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 query token offsets of the requests.
    num_tokens : int
        Tokens to map; tokens past the last request (CUDA-graph padding) map to the last request.
    out : torch.Tensor, optional
        ``[>= num_tokens]`` int32 buffer to write into (its first ``num_tokens`` entries are returned).

    Returns
    -------
    torch.Tensor
        ``[num_tokens]`` int32.
    """
    num_reqs = query_start_loc.numel() - 1
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)
    req = req.clamp_(max=max(num_reqs - 1, 0)).to(torch.int32)
    if out is None:
        return req
    return out[:num_tokens].copy_(req)


def _visible_keys(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, req_ids: torch.Tensor,
                  token_start: int) -> torch.Tensor:
    """Keys visible to tokens ``token_start ..`` (causal, own key included), ``[len(req_ids)]`` int64."""
    req = req_ids.long()
    tokens = torch.arange(token_start, token_start + req.numel(), device=req.device)
    lens = seq_lens.to(req.device).long()[req]
    visible = lens - query_start_loc.to(req.device).long()[req + 1] + tokens + 1
    return torch.minimum(visible, lens).clamp_(min=0)


def build_decode_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    max_context_len: int,
    next_n: int = 1,
    context_lens: torch.Tensor | None = None,
) -> DecodeBatch:
    """:class:`DecodeBatch` of the leading decode tokens, on the device without a host sync.

    Parameters
    ----------
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 query token offsets of the batch's requests.
    seq_lens : torch.Tensor
        ``[B]`` int32 keys of each request once this step's tokens are written.
    block_table : torch.Tensor
        ``[B, max_blocks]`` int32 page ids (kept as given: rows are addressed through ``req_ids``).
    req_ids : torch.Tensor
        ``[T_d]`` int32 request of each decode token (:func:`token_request_ids`).
    max_context_len : int
        Upper bound of the decode requests' ``seq_lens``.
    next_n : int
        Query tokens per decode row: the common query length of the decode requests, or 1 (one
        row per token) when they differ or are not known on the host.
    context_lens : torch.Tensor, optional
        ``[>= T_d]`` int32 buffer for the visible key counts.
    """
    num_tokens = req_ids.numel()
    if next_n < 1 or num_tokens % next_n:
        raise ValueError(f"next_n: {num_tokens} decode tokens do not split into rows of {next_n}")
    visible = _visible_keys(query_start_loc, seq_lens, req_ids, 0).to(torch.int32)
    if context_lens is not None:
        visible = context_lens[:num_tokens].copy_(visible)
    return DecodeBatch(
        num_reqs=num_tokens // next_n, next_n=next_n, context_lens=visible.view(-1, next_n),
        block_table=block_table, req_ids=req_ids, max_context_len=int(max_context_len),
    )


def build_prefill_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    page_size: int,
    first_req: int,
    token_start: int,
    num_keys: int,
) -> PrefillBatch:
    """:class:`PrefillBatch` of the requests ``first_req ..`` (tokens ``token_start ..``), on the device.

    Parameters
    ----------
    query_start_loc, seq_lens, block_table : torch.Tensor
        As in :func:`build_decode_batch`, for the whole batch.
    req_ids : torch.Tensor
        ``[T_p]`` int32 request of each prefill token.
    num_keys : int
        Keys of the prefill requests together (``sum(seq_lens[first_req:])``, known on the host).
    """
    device = block_table.device
    lens = seq_lens.to(device).long()[first_req:]
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=cu[1:])
    req = req_ids.to(device)
    starts = cu[req.long() - first_req]
    ends = starts + _visible_keys(query_start_loc, seq_lens, req, token_start)
    return PrefillBatch(
        token_start=token_start, num_tokens=req.numel(),
        key_slots=request_key_slots(block_table[first_req:], cu, page_size, num_keys),
        cu_seq_len_k_start=starts.to(torch.int32), cu_seq_len_k_end=ends.to(torch.int32),
    )


def request_key_slots(block_table: torch.Tensor, cu_seq_lens: torch.Tensor, page_size: int,
                      num_keys: int) -> torch.Tensor:
    """Cache slots of every key of some requests, request after request (a prefill key buffer).

    Parameters
    ----------
    block_table : torch.Tensor
        ``[R, max_blocks]`` int32 page ids of the ``R`` requests.
    cu_seq_lens : torch.Tensor
        ``[R + 1]`` prefix sums of the requests' key counts.
    num_keys : int
        ``cu_seq_lens[-1]``, known on the host.

    Returns
    -------
    torch.Tensor
        ``[num_keys]`` int64; key ``cu_seq_lens[r] + p`` is position ``p`` of request ``r``.
    """
    device = block_table.device
    cu = cu_seq_lens.to(device=device, dtype=torch.int64)
    keys = torch.arange(num_keys, device=device)
    key_req = torch.searchsorted(cu[1:].contiguous(), keys, right=True)
    pos = keys - cu[key_req]
    pages = block_table[key_req, torch.div(pos, page_size, rounding_mode="floor")].long()
    return pages * page_size + pos % page_size


def build_sparse_attn_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    num_decode_reqs: int,
    device: torch.device | None = None,
) -> SparseAttnMetadata:
    """Build :class:`SparseAttnMetadata` from the fields every framework has.

    Parameters
    ----------
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 on the CPU: query token offsets of the requests.
    seq_lens : torch.Tensor
        ``[B]`` int32 on the CPU: tokens in each request's cache once this step's tokens are written.
    block_table : torch.Tensor
        ``[B, max_blocks]`` int32 page ids (on the compute device).
    slot_mapping : torch.Tensor
        ``[T]`` int32/int64 slots of the new tokens (on the compute device).
    page_size : int
        Tokens per page.
    num_decode_reqs : int
        The first ``num_decode_reqs`` requests are decode requests; they must all have the same
        number of query tokens.
    device : torch.device, optional
        Device of the built tensors (defaults to ``block_table.device``).
    """
    device = device or block_table.device
    qsl = [int(x) for x in query_start_loc.cpu().tolist()]
    lens = [int(x) for x in seq_lens.cpu().tolist()]
    B = len(lens)
    if len(qsl) != B + 1:
        raise ValueError(f"query_start_loc: expected {B + 1} entries for {B} requests, got {len(qsl)}")
    if not 0 <= num_decode_reqs <= B:
        raise ValueError(f"num_decode_reqs: expected 0..{B}, got {num_decode_reqs}")
    q_lens = [qsl[i + 1] - qsl[i] for i in range(B)]
    for r in range(B):
        if q_lens[r] > lens[r]:
            raise ValueError(f"seq_lens: request {r} has {q_lens[r]} query tokens but only {lens[r]} keys")
    md = SparseAttnMetadata(page_size=page_size, num_tokens=qsl[-1],
                            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64))
    qsl_d = torch.tensor(qsl, dtype=torch.int32, device=device)
    lens_d = torch.tensor(lens, dtype=torch.int32, device=device)
    table = block_table.to(device)
    req_ids = token_request_ids(qsl_d, qsl[-1])
    num_decode_tokens = qsl[num_decode_reqs]
    if num_decode_reqs:
        next_n = q_lens[0]
        if any(n != next_n for n in q_lens[:num_decode_reqs]):
            raise ValueError(f"query_start_loc: decode requests must have the same number of query tokens, "
                             f"got {q_lens[:num_decode_reqs]}")
        md.decode = build_decode_batch(qsl_d, lens_d, table[:num_decode_reqs], req_ids[:num_decode_tokens],
                                       max(lens[:num_decode_reqs]), next_n)
    if num_decode_reqs < B:
        md.prefill = build_prefill_batch(qsl_d, lens_d, table, req_ids[num_decode_tokens:], page_size,
                                         num_decode_reqs, num_decode_tokens, sum(lens[num_decode_reqs:]))
    return md
