"""Per-batch metadata of the nsa-backend sparse-MLA backend for vLLM (no vLLM import).

:class:`NsaSparseMLAMetadata` is what ``backend.NsaSparseMLAMetadataBuilder`` builds from vLLM's
``CommonAttentionMetadata`` once per batch and what the impl reads in every layer.
Dimensions: ``T`` tokens of the batch (``num_actual_tokens``), ``B`` requests, ``M`` block
table width, ``page`` tokens per KV-cache block (64).

vLLM orders a batch as decode requests first, then prefill requests; ``num_decode_tokens``
splits the token axis accordingly. The batch itself is described by ``core``, nsa-backend's
framework-independent :class:`~nsa_backend.metadata.SparseAttnMetadata` that the attention runs
on; the other fields are the ones vLLM's MLA layer and model runner read. The MLA layer also reads
``prefill`` and ``decode``; both stay ``None`` so that every token goes through the sparse (MQA)
path.
"""

from __future__ import annotations

import dataclasses

import torch

from nsa_backend.metadata import SparseAttnMetadata


@dataclasses.dataclass
class NsaSparseMLAMetadata:
    """Sparse-MLA metadata of one batch, shared by all layers of a KV-cache group."""

    num_reqs: int
    """``B``, the number of requests in the batch."""
    num_actual_tokens: int
    """``T``, the number of (unpadded) tokens in the batch."""
    max_query_len: int
    """Longest query of the batch."""
    max_seq_len: int
    """Longest context (an upper bound)."""
    query_start_loc: torch.Tensor
    """``[B + 1]`` int32: start of each request's tokens on the token axis."""
    seq_lens: torch.Tensor
    """``[B]`` int32: context length of each request, this step's tokens included."""
    block_table: torch.Tensor
    """``[B, M]`` int32: KV-cache block ids of each request (kernel-sized blocks)."""
    slot_mapping: torch.Tensor
    """``[T]`` int64: KV-cache slot written by each token (``-1``: none)."""
    req_id_per_token: torch.Tensor
    """``[T]`` int32: request index (row of ``block_table``) of each token."""
    block_size: int = 64
    """``page``, tokens per KV-cache block."""
    topk_tokens: int = 2048
    """``index_topk`` of the model: width of the top-k index rows."""
    num_decodes: int = 0
    """Requests served as decodes (query length <= the reorder threshold); they come first."""
    num_decode_tokens: int = 0
    """Tokens of the decode requests: ``token < num_decode_tokens`` runs the decode kernel."""
    num_prefills: int = 0
    """Requests served as prefills."""
    num_prefill_tokens: int = 0
    """Tokens of the prefill requests (``T - num_decode_tokens``)."""
    decode_max_query_len: int = 0
    """Longest query among the decode requests (1, or 1 + speculative tokens)."""
    prefill_max_seq_len: int = 0
    """Longest context among the prefill requests."""
    core: SparseAttnMetadata | None = None
    """The batch in nsa-backend's form: ``core.decode`` holds the ``num_decode_tokens`` leading tokens
    one per row (``next_n = 1``: decode query lengths are decided on the device under speculative
    decoding), ``core.prefill`` the rest with the keys of the prefill requests."""
    prefill: None = None
    """Always ``None``: no dense-MHA prefill; vLLM then runs all tokens through ``forward_mqa``."""
    decode: None = None
    """Always ``None``: the sparse path keeps its decode metadata in ``core``."""


def split_decodes_and_prefills(
    query_start_loc_cpu: torch.Tensor, num_tokens: int, decode_threshold: int
) -> tuple[int, int, int, int]:
    """Split a reordered batch into leading decode and trailing prefill requests.

    Parameters
    ----------
    query_start_loc_cpu : torch.Tensor
        ``[B + 1]`` int32 on the CPU.
    num_tokens : int
        ``T``, tokens of the batch.
    decode_threshold : int
        Longest query still served as a decode.

    Returns
    -------
    tuple of int
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
    """
    num_reqs = query_start_loc_cpu.numel() - 1
    if num_reqs <= 0:
        return 0, 0, 0, 0
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    is_prefill = query_lens > decode_threshold
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(torch.argmax(is_prefill.to(torch.int32)))
    num_decode_tokens = int(query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens

