"""Adapter from SGLang's DSA metadata to :class:`nsa_backend.metadata.SparseAttnMetadata`.

SGLang builds one ``DSAMetadata`` per forward batch (``DeepseekSparseAttnBackend.init_forward_metadata``)
and hands the indexer a ``DSAIndexerMetadata`` that wraps it. Releases before the DSA rename call
them ``NSAMetadata`` / ``NSAIndexerMetadata`` with ``nsa_*`` field names; both are accepted.

SGLang batches are of one kind at a time, named by ``mode``:

- ``"decode"``: one query token per request;
- ``"verify"``: MTP / EAGLE target verify (and draft-extend v2), ``next_n`` query tokens per request;
- ``"prefill"``: extend, any number of query tokens per request, causal.

The fields read (``T`` query tokens, ``B`` requests; shapes as SGLang builds them):

==============================  =========================  ==========================================
field                           shape / type               meaning
==============================  =========================  ==========================================
``page_size``                   int                        tokens per KV-cache page (64)
``cache_seqlens_int32``         ``[B]`` int32              keys per request, draft tokens included
``max_seq_len_k``               int                        ``max(cache_seqlens_int32)``
``page_table_1``                ``[B or T, max_k]`` int32  cache slot of every key position
``real_page_table``             ``[B or T, pages]`` int32  page id of every page (rows per token in verify)
``dsa_extend_seq_lens_list``    ``list[int]`` of ``B``     query tokens of each request (see below)
``dsa_seqlens_expanded``        ``[T]`` int32              keys visible to each query token (causal)
``page_table_1_flattened``      ``[sum keys]`` int32       prefill with a cached prefix: slots of all keys
``indexer_k_start_end``         2 x ``[T]`` int32          prefill: window of each token in the key buffer
``indexer_seq_lens_cpu``        ``[B]`` int (CPU)          prefill: keys per request
``paged_mqa_schedule_metadata`` ``[num_sms + 1, 2]`` int32 decode / verify: paged-logits schedule
==============================  =========================  ==========================================

The CUDA-graph metadata of a verify / draft-extend batch (SGLang's
``_build_forward_metadata_cuda_graph``) lists ``dsa_extend_seq_lens_list`` per query token,
``[1] * (B * next_n)``; it is read as ``next_n`` query tokens per request.
"""

from __future__ import annotations

from typing import Any

import torch

from nsa_backend.metadata import DecodeBatch, PrefillBatch, SparseAttnMetadata, token_request_ids

MODES: tuple[str, ...] = ("decode", "verify", "prefill")


def field(md: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` (``dsa_*`` spelling) from a DSA or an older NSA metadata object."""
    if hasattr(md, name):
        return getattr(md, name)
    if name.startswith("dsa_"):
        old = "nsa_" + name[len("dsa_") :]
        if hasattr(md, old):
            return getattr(md, old)
    return default


def unwrap(md: Any) -> Any:
    """The attention metadata of an indexer metadata object (or ``md`` itself)."""
    inner = getattr(md, "attn_metadata", None)
    return md if inner is None else inner


def mode_of_forward(forward_mode: Any) -> str:
    """``"decode"`` / ``"verify"`` / ``"prefill"`` for an SGLang ``ForwardMode``."""
    if forward_mode.is_decode_or_idle():
        return "decode"
    if forward_mode.is_target_verify() or (
        hasattr(forward_mode, "is_draft_extend_v2") and forward_mode.is_draft_extend_v2()
    ):
        return "verify"
    return "prefill"


def infer_mode(md: Any) -> str:
    """Guess the batch kind of a metadata object built without a known forward mode."""
    md = unwrap(md)
    if field(md, "topk_indices_offset") is not None or field(md, "indexer_k_start_end") is not None:
        return "prefill"
    q_lens = list(field(md, "dsa_extend_seq_lens_list") or [])
    num_reqs = int(md.cache_seqlens_int32.shape[0])
    if q_lens and all(n == 1 for n in q_lens) and len(q_lens) == num_reqs:
        return "decode"
    if q_lens and len(set(q_lens)) == 1:
        return "verify"
    return "prefill"


def _query_lens(md: Any, num_reqs: int, mode: str | None = None) -> list[int]:
    """Query tokens per request.

    SGLang's CUDA-graph metadata of a verify / draft-extend batch
    (``DeepseekSparseAttnBackend._build_forward_metadata_cuda_graph``) lists one length of 1 per
    query token, ``[1] * (B * next_n)``, instead of ``[next_n] * B``; in ``"verify"`` mode (and
    when the mode is not known) such a list is read as ``next_n`` query tokens per request.
    """
    q_lens = field(md, "dsa_extend_seq_lens_list")
    if q_lens is None:
        return [1] * num_reqs
    q_lens = [int(n) for n in q_lens]
    count = len(q_lens)
    if (
        mode in (None, "verify")
        and num_reqs
        and count != num_reqs
        and count % num_reqs == 0
        and all(n == 1 for n in q_lens)
    ):
        return [count // num_reqs] * num_reqs
    return q_lens


def _key_lens(md: Any) -> list[int]:
    seq_lens_cpu = field(md, "indexer_seq_lens_cpu")
    if seq_lens_cpu is None:
        seq_lens_cpu = md.cache_seqlens_int32.cpu()
    return [int(x) for x in torch.as_tensor(seq_lens_cpu).tolist()]


def ragged_key_slots(md: Any, device: torch.device | None = None) -> torch.Tensor:
    """Cache slots of SGLang's ragged key buffer: the keys of every request of a batch, in order.

    A ``RAGGED`` top-k index is a row of this buffer. Returns ``[sum(seq_lens)]`` int64.
    """
    md = unwrap(md)
    return _ragged_key_slots(md, _key_lens(md), device or md.cache_seqlens_int32.device)


def _ragged_key_slots(md: Any, seq_lens: list[int], device: torch.device) -> torch.Tensor:
    flat = field(md, "page_table_1_flattened")
    if flat is None:
        table = md.page_table_1
        q_lens = _query_lens(md, len(seq_lens))
        # A table expanded to one row per query token (draft extend) starts request r at this row.
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        rows = (
            starts
            if table.shape[0] == sum(q_lens) and table.shape[0] != len(seq_lens)
            else range(len(seq_lens))
        )
        flat = (
            torch.cat([table[row, :length] for row, length in zip(rows, seq_lens)])
            if seq_lens
            else table.new_empty(0)
        )
    return flat.to(device=device, dtype=torch.int64)


def _prefill_batch(md: Any, q_lens: list[int], device: torch.device) -> PrefillBatch:
    """Key buffer = the keys of every request in order; windows from the indexer's k range."""
    seq_lens = _key_lens(md)
    k_range = field(md, "indexer_k_start_end")
    if k_range is not None and k_range[0] is not None:
        ks, ke = k_range
    else:
        expanded = field(md, "dsa_seqlens_expanded")
        offsets = torch.tensor([0, *seq_lens[:-1]], dtype=torch.int64).cumsum(0)
        ks = torch.repeat_interleave(offsets, torch.tensor(q_lens)).to(device=device, dtype=torch.int32)
        ke = ks + expanded.to(device=device, dtype=torch.int32)
    return PrefillBatch(
        token_start=0,
        num_tokens=sum(q_lens),
        key_slots=_ragged_key_slots(md, seq_lens, device),
        cu_seq_len_k_start=ks.to(torch.int32),
        cu_seq_len_k_end=ke.to(torch.int32),
    )


def _decode_batch(md: Any, q_lens: list[int], device: torch.device) -> DecodeBatch:
    num_reqs = len(q_lens)
    next_n = q_lens[0] if q_lens else 1
    table = md.real_page_table
    if table.shape[0] == num_reqs * next_n and next_n > 1:
        table = table[::next_n]  # verify tables are expanded to one row per query token
    if next_n == 1:
        context_lens = md.cache_seqlens_int32.view(num_reqs, 1)
    else:
        context_lens = field(md, "dsa_seqlens_expanded")[: num_reqs * next_n].view(num_reqs, next_n)
    return DecodeBatch(
        num_reqs=num_reqs,
        next_n=next_n,
        context_lens=context_lens.to(device=device, dtype=torch.int32),
        block_table=table[:num_reqs].to(device),
        req_ids=torch.arange(num_reqs, dtype=torch.int32, device=device).repeat_interleave(next_n),
        max_context_len=int(md.max_seq_len_k),
        schedule_meta=field(md, "paged_mqa_schedule_metadata"),
    )


def _token_decode_batch(md: Any, q_lens: list[int], device: torch.device) -> DecodeBatch:
    """Every query token its own decode row (``next_n = 1``), reading the paged cache."""
    num_reqs, num_tokens = len(q_lens), sum(q_lens)
    table = md.real_page_table
    rows = table.shape[0]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    req_ids = token_request_ids(query_start_loc, num_tokens)
    if rows == num_tokens and rows != num_reqs:  # expanded to one row per query token (draft extend)
        req_ids = torch.arange(num_tokens, dtype=torch.int32, device=device)
    elif rows != num_reqs and num_reqs and rows % num_reqs == 0:  # a fixed number of rows per request
        req_ids = req_ids * (rows // num_reqs)
    return DecodeBatch(
        num_reqs=num_tokens,
        next_n=1,
        context_lens=field(md, "dsa_seqlens_expanded")[:num_tokens]
        .to(device=device, dtype=torch.int32)
        .reshape(num_tokens, 1),
        block_table=table.to(device),
        req_ids=req_ids,
        max_context_len=int(md.max_seq_len_k),
    )


def to_sparse_attn_metadata(
    md: Any,
    mode: str | None = None,
    slot_mapping: torch.Tensor | None = None,
    *,
    token_rows: bool = False,
) -> SparseAttnMetadata:
    """Adapt an SGLang ``DSAMetadata`` / ``DSAIndexerMetadata`` (or ``NSA*``) object.

    Parameters
    ----------
    md : DSAMetadata | DSAIndexerMetadata | NSAMetadata | NSAIndexerMetadata
        Metadata of one forward batch.
    mode : str, optional
        ``"decode"``, ``"verify"`` or ``"prefill"`` (see :func:`mode_of_forward`); guessed from the
        fields when omitted.
    slot_mapping : torch.Tensor, optional
        ``[T]`` cache slots of this step's tokens (SGLang's ``forward_batch.out_cache_loc``);
        ``-1`` (no write) when omitted.
    token_rows : bool
        Describe a batch that is not an even decode / verify batch (prefill, mixed chunk, uneven
        draft extend) as one decode row per query token (``decode`` with ``next_n = 1``) that reads
        its selected keys from the paged cache, instead of ``prefill`` over a gathered key buffer.

    Returns
    -------
    SparseAttnMetadata
        Decode and verify batches whose requests have the same number of query tokens fill
        ``decode`` (``next_n`` = query tokens per request). Other batches fill ``decode`` with one
        row per token when ``token_rows``, and ``prefill`` otherwise, with the keys of every request
        in order (the layout of SGLang's ragged key buffer, so a ragged top-k position is an index
        into ``prefill.key_slots``, see :func:`ragged_key_slots`).
    """
    md = unwrap(md)
    mode = mode or infer_mode(md)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
    device = md.cache_seqlens_int32.device
    num_reqs = int(md.cache_seqlens_int32.shape[0])
    q_lens = _query_lens(md, num_reqs, mode)
    if len(q_lens) != num_reqs:
        raise ValueError(
            f"{type(md).__name__}: {len(q_lens)} query lengths for {num_reqs} requests "
            "(context-parallel prefill shards are not supported)"
        )
    num_tokens = sum(q_lens)
    if slot_mapping is None:
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    out = SparseAttnMetadata(
        page_size=int(md.page_size),
        num_tokens=num_tokens,
        slot_mapping=slot_mapping[:num_tokens].to(torch.int64),
    )
    if mode in ("decode", "verify") and len(set(q_lens)) <= 1:
        out.decode = _decode_batch(md, q_lens, device)
    elif token_rows:
        out.decode = _token_decode_batch(md, q_lens, device)
    else:
        out.prefill = _prefill_batch(md, q_lens, device)
    return out
