"""Triton kernels of the top-k selection and of the logical-to-global index translation.

``topk_indices``: columns ``[lo, hi)`` of row ``r`` are the candidates (``lo = max(starts[r], 0)``,
``hi = min(ends[r], N)``). Rows with at most ``topk`` valid columns get all of them (in column
order) and ``-1`` after. Other rows are resolved on an order-preserving 32-bit key of the float
bits (NaN above ``+inf``, as ``torch.topk``; ``-inf`` is a valid value):

    key = ~bits  if the sign bit is set  else  bits | 0x80000000

1. ``_topk_histogram_kernel`` (twice): 256-bin histogram of key bits 31..24, then of bits 23..16
   among the keys whose bits 31..24 are the digit holding the ``topk``-th key; a row is split over
   ``SPLIT`` programs that add their partial histograms with atomics.
2. ``_topk_filter_kernel``: keys whose top 16 bits exceed that 16-bit threshold prefix go straight
   to the output, keys with the prefix to a candidate list (slots reserved with an atomic counter,
   so the order inside a row varies between runs).
3. ``_topk_finish_kernel``: radix select with 8-bit digits on bits 15..0 among the candidates (or
   among the whole row when the prefix overflowed the list, e.g. with massive ties), stopping
   once the matching bucket holds exactly the number still needed, then writes the keys above the
   threshold and the first ``needed`` keys equal to it. Each row gets exactly ``topk`` indices,
   ties included.

The row is streamed three times (mostly from L2 after the first); only the candidates are read
again. No host synchronisation; temporary buffers are sized by shapes only.

``logical_to_global_indices``: element-wise; ``slot = block_table[req, pos // page] * page +
pos % page``; ``-1`` for negative positions, pages past the table and negative table entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend.configs import topk as cfgs
from nsa_backend.kernels._arch import device_sms

__all__ = ["logical_to_global_indices_triton", "topk_indices_triton"]


@triton.jit
def _topk_ordered_key(x):
    # float32 -> uint32 whose unsigned order is the float order
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    return tl.where(neg, ~bits, bits | 0x80000000)


@triton.jit
def _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS: tl.constexpr, HAS_ENDS: tl.constexpr):
    lo = 0
    hi = N
    if HAS_STARTS:
        lo = tl.maximum(tl.load(starts_ptr + i_r), 0)
    if HAS_ENDS:
        hi = tl.minimum(tl.load(ends_ptr + i_r), N)
    return lo, tl.maximum(hi, lo)


# Row-window flags of the kernels that take optional ``starts`` / ``ends``.
_row_window_flags = triton.heuristics({
    "HAS_STARTS": lambda args: args["starts_ptr"] is not None,
    "HAS_ENDS": lambda args: args["ends_ptr"] is not None,
})


@triton.jit
def _topk_digit_threshold(p_hist, K):
    # the bin of a 256-bin histogram holding the K-th largest key: (bin, keys above, keys in it)
    o_bin = tl.arange(0, 256)
    b_hist = tl.load(p_hist + o_bin)
    b_suffix = tl.sum(b_hist, axis=0) - tl.cumsum(b_hist, axis=0) + b_hist  # keys in bins >= d
    sel = tl.max(tl.where(b_suffix >= K, o_bin, -1), axis=0)
    above = tl.sum(tl.where(o_bin > sel, b_hist, 0), axis=0)
    in_bin = tl.sum(tl.where(o_bin == sel, b_hist, 0), axis=0)
    return sel, above, in_bin


@triton.jit
def _topk_threshold16(p_hist, K):
    # top 16 key bits of the K-th largest key from the two 8-bit histograms of a row:
    # (16-bit prefix, keys with a larger prefix, keys with this prefix)
    sel1, above1, _ = _topk_digit_threshold(p_hist, K)
    sel2, above2, in_bin = _topk_digit_threshold(p_hist + 256, K - above1)
    return (sel1 << 8) | sel2, above1 + above2, in_bin


@_row_window_flags
@triton.jit(do_not_specialize=["N", "K", "SPLIT"])
def _topk_histogram_kernel(
    x_ptr,
    hist_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_x,
    SPLIT,
    BLOCK: tl.constexpr,
    LEVEL: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # LEVEL 0: histogram of key bits 31..24; LEVEL 1: of bits 23..16 among the keys whose bits
    # 31..24 are the threshold digit of level 0. Row i_r, tiles i_s, i_s + SPLIT, ...
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    lo, hi = _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS, HAS_ENDS)
    if hi - lo > K:
        p_hist = hist_ptr + i_r.to(tl.int64) * 512
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        o_b = tl.arange(0, BLOCK)
        o_bin = tl.arange(0, 256)
        sel1 = -1
        if LEVEL == 1:
            sel1, _, _ = _topk_digit_threshold(p_hist, K)
        b_hist = tl.zeros([256], dtype=tl.int32)
        for t0 in range(lo + i_s * BLOCK, hi, SPLIT * BLOCK):
            o_t = t0 + o_b
            m_t = o_t < hi
            b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            if LEVEL == 0:
                m_c = m_t
                b_dig = (b_key >> 24).to(tl.int32)
            else:
                m_c = m_t & ((b_key >> 24).to(tl.int32) == sel1)
                b_dig = ((b_key >> 16) & 0xFF).to(tl.int32)
            b_hist += tl.histogram(tl.where(m_c, b_dig, 0), 256)
            # lanes that are not counted went to bin 0
            b_hist -= tl.where(o_bin == 0, BLOCK - tl.sum(m_c.to(tl.int32), axis=0), 0)
        tl.atomic_add(p_hist + LEVEL * 256 + o_bin, b_hist, mask=b_hist != 0, sem="relaxed")


@_row_window_flags
@triton.jit(do_not_specialize=["N", "K", "SPLIT", "CAP"])
def _topk_filter_kernel(
    x_ptr,
    hist_ptr,
    count_ptr,
    cand_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_x,
    SPLIT,
    CAP,
    BLOCK: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # keys whose top 16 bits exceed the threshold prefix go to the output; keys with the prefix go
    # to the candidate list (when it has room; otherwise the finishing kernel scans the row)
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    lo, hi = _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS, HAS_ENDS)
    if hi - lo > K:
        thr, _, in_bin = _topk_threshold16(hist_ptr + i_r.to(tl.int64) * 512, K)
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        p_out = out_ptr + i_r.to(tl.int64) * K
        p_cand = cand_ptr + i_r.to(tl.int64) * CAP
        p_cnt = count_ptr + i_r * 2
        o_b = tl.arange(0, BLOCK)
        m_list = (o_b * 0 + in_bin) <= CAP  # [BLOCK], the same for every lane
        for t0 in range(lo + i_s * BLOCK, hi, SPLIT * BLOCK):
            o_t = t0 + o_b
            m_t = o_t < hi
            b_dig = (_topk_ordered_key(tl.load(p_x + o_t, mask=m_t, other=0.0)) >> 16).to(tl.int32)
            m_gt = m_t & (b_dig > thr)
            m_eq = m_t & (b_dig == thr) & m_list
            n_gt = tl.sum(m_gt.to(tl.int32), axis=0)
            n_eq = tl.sum(m_eq.to(tl.int32), axis=0)
            if n_gt > 0:
                base = tl.atomic_add(p_cnt, n_gt, sem="relaxed")
                tl.store(p_out + base + tl.cumsum(m_gt.to(tl.int32), axis=0) - 1, o_t, mask=m_gt)
            if n_eq > 0:
                base = tl.atomic_add(p_cnt + 1, n_eq, sem="relaxed")
                tl.store(p_cand + base + tl.cumsum(m_eq.to(tl.int32), axis=0) - 1, o_t, mask=m_eq)


@_row_window_flags
@triton.jit(do_not_specialize=["N", "K", "CAP"])
def _topk_finish_kernel(
    x_ptr,
    hist_ptr,
    cand_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_x,
    CAP,
    BLOCK: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # exact selection among the keys with the threshold prefix: radix select on bits 15..0 over
    # the candidate list (or over the whole row when it overflowed the list), then compaction of
    # the chosen keys into output positions [above, K)
    i_r = tl.program_id(0)
    lo, hi = _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS, HAS_ENDS)
    n_valid = hi - lo
    p_out = out_ptr + i_r.to(tl.int64) * K
    o_b = tl.arange(0, BLOCK)
    if n_valid <= K:
        for j0 in range(0, K, BLOCK):
            o_j = j0 + o_b
            tl.store(p_out + o_j, tl.where(o_j < n_valid, lo + o_j, -1), mask=o_j < K)
    else:
        thr, above, in_bin = _topk_threshold16(hist_ptr + i_r.to(tl.int64) * 512, K)
        n_src = tl.where(in_bin <= CAP, in_bin, n_valid)
        m_list = (o_b * 0 + in_bin) <= CAP  # [BLOCK], the same for every lane
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        p_cand = cand_ptr + i_r.to(tl.int64) * CAP
        o_bin = tl.arange(0, 256)
        prefix = thr.to(tl.uint32) << 16
        keep = tl.full([], 0xFFFF0000, tl.uint32)
        need = K - above
        shift = tl.full([], 16, tl.uint32)
        go = in_bin != need
        while go:
            shift -= 8
            b_hist = tl.zeros([256], dtype=tl.int32)
            for j0 in range(0, n_src, BLOCK):
                o_j = j0 + o_b
                m_j = o_j < n_src
                o_t = tl.where(m_list, tl.load(p_cand + o_j, mask=m_j & m_list, other=0), lo + o_j)
                b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_j, other=0.0))
                m_c = m_j & ((b_key & keep) == prefix)
                b_dig = tl.where(m_c, ((b_key >> shift) & 0xFF).to(tl.int32), 0)
                b_hist += tl.histogram(b_dig, 256)
                b_hist -= tl.where(o_bin == 0, BLOCK - tl.sum(m_c.to(tl.int32), axis=0), 0)
            b_suffix = tl.sum(b_hist, axis=0) - tl.cumsum(b_hist, axis=0) + b_hist
            d = tl.max(tl.where(b_suffix >= need, o_bin, -1), axis=0)
            need -= tl.sum(tl.where(o_bin > d, b_hist, 0), axis=0)
            in_d = tl.sum(tl.where(o_bin == d, b_hist, 0), axis=0)
            prefix |= d.to(tl.uint32) << shift
            keep |= tl.full([], 0xFF, tl.uint32) << shift
            go = (shift > 0) & (in_d != need)
        # keys with the threshold prefix above the final prefix, then the first `need` equal to it
        k_gt = K - above - need
        n_gt = 0
        n_eq = 0
        for j0 in range(0, n_src, BLOCK):
            o_j = j0 + o_b
            m_j = o_j < n_src
            o_t = tl.where(m_list, tl.load(p_cand + o_j, mask=m_j & m_list, other=0), lo + o_j)
            b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_j, other=0.0))
            m_bin = m_j & ((b_key >> 16).to(tl.int32) == thr)
            b_key = b_key & keep
            m_gt = m_bin & (b_key > prefix)
            m_eq = m_bin & (b_key == prefix)
            c_gt = tl.cumsum(m_gt.to(tl.int32), axis=0)
            c_eq = tl.cumsum(m_eq.to(tl.int32), axis=0)
            tl.store(p_out + above + n_gt + c_gt - 1, o_t, mask=m_gt)
            r_eq = n_eq + c_eq - 1
            tl.store(p_out + above + k_gt + r_eq, o_t, mask=m_eq & (r_eq < need))
            n_gt += tl.sum(m_gt.to(tl.int32), axis=0)
            n_eq += tl.sum(m_eq.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["K", "B", "M", "page_size"])
def _topk_logical_to_global_kernel(
    idx_ptr,
    bt_ptr,
    req_ptr,
    out_ptr,
    K,
    B,
    M,
    stride_bt,
    page_size,
    BLOCK: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_k = tl.program_id(1)
    o_k = i_k * BLOCK + tl.arange(0, BLOCK)
    m_k = o_k < K
    p_row = i_r.to(tl.int64) * K
    b_pos = tl.load(idx_ptr + p_row + o_k, mask=m_k, other=-1).to(tl.int64)
    b_req = tl.zeros([BLOCK], dtype=tl.int64) + tl.load(req_ptr + i_r)
    b_page = b_pos // page_size
    m_ok = m_k & (b_pos >= 0) & (b_page < M) & (b_req >= 0) & (b_req < B)
    b_blk = tl.load(bt_ptr + b_req * stride_bt + b_page, mask=m_ok, other=-1).to(tl.int64)
    b_slot = b_blk * page_size + b_pos % page_size
    b_slot = tl.where(m_ok & (b_blk >= 0), b_slot, -1)
    tl.store(out_ptr + p_row + o_k, b_slot.to(tl.int32), mask=m_k)


def topk_indices_triton(
    logits: torch.Tensor,
    topk: int,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    *,
    config: cfgs.TopkConfig | None = None,
) -> torch.Tensor:
    """Triton ``topk_indices`` (see :func:`nsa_backend.topk_indices`), on validated inputs.

    Four launches, no host synchronisation, allocations sized by shapes only: two histogram passes
    over the top key bits (rows split over ``split`` programs), a filter pass and a per-row finish.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, N]`` ``float32``.
    topk : int
        Indices per row.
    starts, ends : torch.Tensor, optional
        ``[R]`` ``int32``: row ``i`` selects among columns ``[starts[i], ends[i])`` (default ``0`` and ``N``).
    config : TopkConfig, optional
        Launch configuration overriding ``nsa_backend.configs.topk.topk_config``.

    Returns
    -------
    torch.Tensor
        ``[R, topk]`` ``int32`` column indices, ``-1`` padded when a row has fewer valid columns.
    """
    R, N = logits.shape
    out = torch.empty(R, topk, dtype=torch.int32, device=logits.device)
    if R == 0:
        return out
    cfg = config or cfgs.topk_config(N, R)
    split = cfgs.row_split(R, N, cfg.block, device_sms(logits.device))
    zeroed = torch.zeros(R * (512 + 2), dtype=torch.int32, device=logits.device)
    hist = zeroed[:R * 512].view(R, 512)  # two 256-bin histograms per row (key bits 31..24, 23..16)
    counters = zeroed[R * 512:].view(R, 2)  # keys written to the output / to the candidate list
    cap = cfgs.candidate_capacity(N)
    cand = torch.empty(R, cap, dtype=torch.int32, device=logits.device)
    stride = logits.stride(0)
    for level in (0, 1):
        _topk_histogram_kernel[(R, split)](logits, hist, starts, ends, N, topk, stride, split,
                                           BLOCK=cfg.block, LEVEL=level, num_warps=cfg.num_warps)
    _topk_filter_kernel[(R, split)](logits, hist, counters, cand, out, starts, ends, N, topk, stride, split,
                                    cap, BLOCK=cfg.block, num_warps=cfg.num_warps)
    _topk_finish_kernel[(R,)](logits, hist, cand, out, starts, ends, N, topk, stride, cap,
                              BLOCK=cfgs.FINISH_BLOCK, num_warps=cfgs.FINISH_NUM_WARPS)
    return out


def logical_to_global_indices_triton(
    indices: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Triton ``logical_to_global_indices`` (see :func:`nsa_backend.logical_to_global_indices`).

    Parameters
    ----------
    indices : torch.Tensor
        ``[R, K]`` ``int32`` key positions inside each row's request (``-1``: none).
    block_table : torch.Tensor
        ``[B, M]`` ``int32`` page ids.
    req_ids : torch.Tensor
        ``[R]`` ``int32`` request of each row.
    page_size : int
        Tokens per page.

    Returns
    -------
    torch.Tensor
        ``[R, K]`` ``int32`` cache slots ``block_table[req, pos // page_size] * page_size + pos % page_size``;
        ``-1`` for negative positions, pages past the table and negative table entries.
    """
    R, K = indices.shape
    out = torch.empty_like(indices)
    if out.numel() == 0:
        return out
    B, M = block_table.shape
    grid = (R, triton.cdiv(K, cfgs.L2G_BLOCK))
    _topk_logical_to_global_kernel[grid](
        indices, block_table, req_ids, out, K, B, M, block_table.stride(0), page_size,
        BLOCK=cfgs.L2G_BLOCK, num_warps=cfgs.L2G_NUM_WARPS,
    )
    return out
