"""One framework-independent description of a DSA attention batch.

SGLang's ``DSAMetadata`` / ``DSAIndexerMetadata`` and vLLM's ``CommonAttentionMetadata`` /
``DeepseekV32IndexerMetadata`` are adapted to :class:`SparseAttnMetadata` by the integrations;
:mod:`nsa_backend.dsa` runs the indexer, top-k and sparse MLA from it.

Token order: the ``num_decode_reqs`` decode requests come first (each with the same number
``next_n`` of query tokens: 1, or 1 + draft tokens with MTP), then the prefill (extend) requests.
A key position ``p`` of request ``r`` lives in cache slot
``block_table[r, p // page_size] * page_size + p % page_size``.
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
    """``[B_d, max_blocks]`` int32 page ids of the decode requests."""
    req_ids: torch.Tensor
    """``[B_d * next_n]`` int32: row of ``block_table`` for each decode query token."""
    max_context_len: int
    """Upper bound of ``context_lens`` (columns of the paged logits)."""
    schedule_meta: torch.Tensor | None = None
    """``[num_sms + 1, 2]`` int32 paged-logits schedule, built on first use when ``None``."""

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.next_n


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


def _slots(block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    pages = block_table_row[torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages * page_size + positions % page_size


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
    if num_decode_reqs:
        next_n = q_lens[0]
        if any(n != next_n for n in q_lens[:num_decode_reqs]):
            raise ValueError(f"query_start_loc: decode requests must have the same number of query tokens, "
                             f"got {q_lens[:num_decode_reqs]}")
        ctx = torch.tensor([[lens[r] - next_n + j + 1 for j in range(next_n)] for r in range(num_decode_reqs)],
                           dtype=torch.int32)
        md.decode = DecodeBatch(
            num_reqs=num_decode_reqs, next_n=next_n, context_lens=ctx.to(device),
            block_table=block_table[:num_decode_reqs].to(device),
            req_ids=torch.arange(num_decode_reqs, dtype=torch.int32).repeat_interleave(next_n).to(device),
            max_context_len=max(lens[:num_decode_reqs]),
        )
    if num_decode_reqs < B:
        key_slots, ks, ke = [], [], []
        offset = 0
        for r in range(num_decode_reqs, B):
            L, n = lens[r], q_lens[r]
            key_slots.append(_slots(block_table[r].cpu(), torch.arange(L), page_size))
            ks += [offset] * n
            ke += [offset + L - n + j + 1 for j in range(n)]
            offset += L
        md.prefill = PrefillBatch(
            token_start=qsl[num_decode_reqs], num_tokens=qsl[-1] - qsl[num_decode_reqs],
            key_slots=torch.cat(key_slots).to(device),
            cu_seq_len_k_start=torch.tensor(ks, dtype=torch.int32, device=device),
            cu_seq_len_k_end=torch.tensor(ke, dtype=torch.int32, device=device),
        )
    return md
