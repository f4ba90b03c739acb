"""Top-k selection of indexer logits and translation of logical positions to KV-cache slots."""

from __future__ import annotations

import torch

from nsa_backend._checks import check_int, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl
from nsa_backend._replay import ReplayCache

MAX_TOPK = 1 << 16
_topk_replays = ReplayCache("topk_indices")


@custom_op("nsa_backend::topk_indices", mutates_args=())
def _topk_indices_op(logits: torch.Tensor, topk: int, starts: torch.Tensor | None, ends: torch.Tensor | None,
                     impl: str) -> torch.Tensor:
    return get_impl("topk_indices", impl)(logits, topk, starts, ends)


@_topk_indices_op.register_fake
def _(logits, topk, starts, ends, impl):
    return logits.new_empty((logits.shape[0], topk), dtype=torch.int32)


def topk_indices(
    logits: torch.Tensor,
    topk: int,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Column indices of the ``topk`` largest logits of each row inside its window.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, N]`` ``float32`` (rows of :func:`fp8_mqa_logits` or :func:`fp8_paged_mqa_logits`).
    topk : int
        Number of indices per row (2048 for current DSA models; 1..65536).
    starts, ends : torch.Tensor, optional
        ``[R]`` ``int32``: row ``i`` considers columns ``[starts[i], ends[i])``; defaults ``0`` and ``N``.

    Returns
    -------
    torch.Tensor
        ``[R, topk]`` ``int32`` column indices (not offsets from ``starts``), ``-1`` where a row has
        fewer than ``topk`` columns. Order inside a row is unspecified; ties are broken arbitrarily.
    """
    values = (logits, topk, starts, ends, impl)
    key = _topk_replays.key(values)
    if (replay := _topk_replays.get(key)) is not None:
        return replay(values)
    dims: dict[str, int] = {}
    check_tensor(logits, "logits", dtype=torch.float32, shape=("R", "N"), dims=dims)
    check_int(topk, "topk", min_value=1, max_value=MAX_TOPK)
    dev = logits.device
    if starts is not None:
        check_tensor(starts, "starts", dtype=torch.int32, shape=("R",), dims=dims, device=dev)
        starts = starts.contiguous()
    if ends is not None:
        check_tensor(ends, "ends", dtype=torch.int32, shape=("R",), dims=dims, device=dev)
        ends = ends.contiguous()
    name = resolve_impl("topk_indices", impl, {"device": dev, "topk": topk, "n": dims["N"]})
    return _topk_replays.run(key, values, name, lambda: _topk_indices_op(logits.contiguous(), topk, starts, ends, name))


@custom_op("nsa_backend::logical_to_global_indices", mutates_args=())
def _logical_to_global_op(indices: torch.Tensor, block_table: torch.Tensor, req_ids: torch.Tensor, page_size: int,
                          impl: str) -> torch.Tensor:
    return get_impl("logical_to_global_indices", impl)(indices, block_table, req_ids, page_size)


@_logical_to_global_op.register_fake
def _(indices, block_table, req_ids, page_size, impl):
    return torch.empty_like(indices)


def logical_to_global_indices(
    indices: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    page_size: int,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Turn per-request logical key positions into global KV-cache slots.

    ``slot = block_table[req, pos // page_size] * page_size + pos % page_size``; ``-1``, negative
    positions and positions past the block table stay ``-1``.

    Parameters
    ----------
    indices : torch.Tensor
        ``[R, K]`` ``int32`` logical positions (e.g. from :func:`topk_indices`).
    block_table : torch.Tensor
        ``[B, max_blocks]`` ``int32``.
    req_ids : torch.Tensor
        ``[R]`` ``int32``: the request (row of ``block_table``) of each index row, in ``[0, B)``.
    page_size : int
        Tokens per page (>= 1).

    Returns
    -------
    torch.Tensor
        ``[R, K]`` ``int32`` global slots.
    """
    dims: dict[str, int] = {}
    check_tensor(indices, "indices", dtype=torch.int32, shape=("R", "K"), dims=dims)
    dev = indices.device
    check_tensor(block_table, "block_table", dtype=torch.int32, shape=("B", None), dims=dims, device=dev)
    check_tensor(req_ids, "req_ids", dtype=torch.int32, shape=("R",), dims=dims, device=dev)
    check_int(page_size, "page_size", min_value=1)
    name = resolve_impl("logical_to_global_indices", impl, {"device": dev, "page_size": page_size})
    return _logical_to_global_op(indices.contiguous(), block_table.contiguous(), req_ids.contiguous(), page_size, name)
