"""Triton kernel that turns decode top-k slots into the form kernels that only skip ``-1`` read safely.

FlashMLA's sparse decode treats an index as invalid only when it is exactly ``-1`` and does not
bound-check the others, works on top-k widths that are a multiple of its block, and (in its V3.2
kernels) takes no per-request top-k length. ``mask_invalid_slots`` writes, in one launch, the
indices with every slot outside ``[0, num_slots)``, every entry past its request's
``topk_length`` and every padding column set to ``-1``; the plain-PyTorch form of the same
computation (several launches) is ``mask_invalid_slots_reference``, the oracle of the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend import envs

__all__ = ["mask_invalid_slots", "mask_invalid_slots_reference"]

BLOCK = 1024


@triton.jit(do_not_specialize=["num_slots", "topk", "width", "rows_per_request"])
def _mask_invalid_slots_kernel(
    idx_ptr,
    len_ptr,
    out_ptr,
    num_slots,
    topk,
    width,
    rows_per_request,
    stride_idx_row,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # idx: [R, topk] int32 (row stride stride_idx_row); len: [R // rows_per_request] int32;
    # out: [R, width] int32, contiguous. Grid: (R, cdiv(width, BLOCK)).
    i_r = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < width
    limit = topk
    if HAS_LEN:
        limit = tl.minimum(tl.load(len_ptr + i_r // rows_per_request), topk)
    b_idx = tl.load(idx_ptr + i_r * stride_idx_row + o_c, mask=o_c < limit, other=-1)
    b_idx = tl.where((b_idx >= 0) & (b_idx < num_slots), b_idx, -1)
    tl.store(out_ptr + i_r * width + o_c, b_idx, mask=m_c)


def _check(indices: torch.Tensor, topk_length: torch.Tensor | None, width: int) -> None:
    if indices.dtype != torch.int32 or indices.dim() != 3:
        raise TypeError(f"indices: expected int32 [B, s_q, topk], got {indices.dtype} {tuple(indices.shape)}")
    if width < indices.shape[-1]:
        raise ValueError(f"width: expected at least topk = {indices.shape[-1]}, got {width}")
    if topk_length is not None:
        if topk_length.dtype != torch.int32 or tuple(topk_length.shape) != (indices.shape[0],):
            raise TypeError(f"topk_length: expected int32 [{indices.shape[0]}], got {topk_length.dtype} "
                            f"{tuple(topk_length.shape)}")
        if topk_length.device != indices.device:
            raise ValueError(f"topk_length: expected device {indices.device}, got {topk_length.device}")


def mask_invalid_slots(
    indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None = None, width: int | None = None
) -> torch.Tensor:
    """Decode slots with everything a kernel must skip set to ``-1``, padded to ``width`` columns.

    Parameters
    ----------
    indices : torch.Tensor
        ``[B, s_q, topk]`` ``int32`` global slots; any value outside ``[0, num_slots)`` is invalid.
    num_slots : int
        Slots in the cache (``num_blocks * page_size``).
    topk_length : torch.Tensor, optional
        ``[B]`` ``int32``: entries at or past ``topk_length[b]`` of request ``b`` become ``-1``.
    width : int, optional
        Columns of the result (``>= topk``, default ``topk``); the extra ones are ``-1``.

    Returns
    -------
    torch.Tensor
        ``[B, s_q, width]`` ``int32``, contiguous, on the device of ``indices``; one launch,
        graph-capturable. Off CUDA (without the Triton interpreter) the PyTorch form computes it.
    """
    if indices.device.type != "cuda" and not envs.triton_interpret():
        return mask_invalid_slots_reference(indices, num_slots, topk_length, width)
    width = indices.shape[-1] if width is None else width
    _check(indices, topk_length, width)
    B, s_q, topk = indices.shape
    out = torch.empty(B, s_q, width, dtype=torch.int32, device=indices.device)
    if out.numel() == 0:
        return out
    rows = indices.reshape(B * s_q, topk)
    if topk and rows.stride(-1) != 1:
        rows = rows.contiguous()
    grid = (B * s_q, triton.cdiv(width, BLOCK))
    _mask_invalid_slots_kernel[grid](
        rows, topk_length if topk_length is not None else rows, out, num_slots, topk, width, s_q,
        rows.stride(0), HAS_LEN=topk_length is not None, BLOCK=BLOCK,
    )
    return out


def mask_invalid_slots_reference(
    indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None = None, width: int | None = None
) -> torch.Tensor:
    """Plain-PyTorch :func:`mask_invalid_slots` (same arguments and result)."""
    width = indices.shape[-1] if width is None else width
    _check(indices, topk_length, width)
    keep = (indices >= 0) & (indices < num_slots)
    if topk_length is not None:
        rank = torch.arange(indices.shape[-1], device=indices.device)
        keep &= rank < topk_length.view(-1, 1, 1)
    out = torch.where(keep, indices, torch.full_like(indices, -1))
    extra = width - indices.shape[-1]
    if extra:
        out = torch.cat([out, out.new_full((*out.shape[:-1], extra), -1)], dim=-1)
    return out.contiguous()
