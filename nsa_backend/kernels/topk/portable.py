"""Triton kernels of the top-k selection and of the logical-to-global index translation.

``topk_indices``: columns ``[lo, hi)`` of row ``r`` are the candidates (``lo = max(starts[r], 0)``,
``hi = min(ends[r], N)``). Rows with at most ``topk`` valid columns get all of them (in column
order) and ``-1`` after. Other rows are resolved on an order-preserving 32-bit key of the float
bits (NaN above ``+inf``, as ``torch.topk``; ``-inf`` is a valid value):

    key = ~bits  if the sign bit is set  else  bits | 0x80000000

Each row gets exactly ``topk`` indices, ties included: the keys above the ``topk``-th largest key
and the first of those equal to it (the order inside a row, and which of several equal keys are
taken, may vary between runs).

Register-resident path (one launch; ``nsa_backend.configs.topk.use_resident_path`` picks it for
many rows of at most ``RESIDENT_MAX_N`` columns, i.e. short prefill rows): ``_topk_resident_kernel`` runs a
persistent grid whose programs take whole rows. A row of at most ``CAP`` columns is loaded into
registers once (64 keys per thread at most). The ``topk``-th largest key is found bit by bit from
the top: one reduction (count of keys >= a trial value) per bit, stopping as soon as exactly
``topk`` keys lie at or above the prefix found so far. The selection is then written by reading
the row again in tiles of ``EMIT_BLOCK`` (from L2), compacted with one scan per tile: writing it
from the register-resident row took about twice the registers. With an explicit smaller
capacity, longer rows are resolved chunk by chunk: the top ``topk`` of each chunk (keys and
columns) go to the program's scratch slab, then the top ``topk`` of those (at most ``FIN``).

Sieve path (``nsa_backend.configs.topk.use_sieve_path`` picks it for rows longer than
``SIEVE_MIN_N`` columns: longer prefill rows, many decode rows, and few very long rows):
``_topk_sieve_kernel`` runs a persistent grid of small programs (two or four warps) whose
programs take whole rows. A row longer than ``DIRECT`` gets a lower bound of its ``topk``-th key
from ``SAMPLE`` keys (aligned runs of 8 columns, vector loads): the sampled key whose rank lies
``SIGMAS`` standard deviations above the expected rank, cut to its top 16 bits, found two bits per
reduction. One pass over the row (full tiles read with vector loads, the next tile's load in
flight) appends the keys at or above the bound (all keys of shorter rows) and their columns to
the program's list (at most ``CAP``), compacted by one scan per tile. The ``topk``-th key of the
list is then found two bits per pass over the list (the three counts packed in one lane counter,
one reduction per pass), below the common prefix of the bound and the largest listed key,
stopping once exactly ``topk`` keys lie at or above the prefix; one more pass counts the keys
above it and one writes the selection. When the bound misses (fewer than ``topk`` or more than
``CAP`` keys listed, e.g. massive ties) the row is resolved by the streaming radix select below.
With fewer rows than SMs, ``_topk_sieve_part_kernel`` splits each row over parts that append to
the row's list through an atomic counter (every part computes the same bound), and
``_topk_sieve_merge_kernel`` resolves each row's list.

Whole-row path (one launch; ``nsa_backend.configs.topk.use_row_path`` picks it for the other rows
with ``topk <= ROW_MAX_TOPK``: few or short decode rows): ``_topk_row_kernel`` runs a persistent
grid whose programs take whole rows.

- Rows of at most ``CAP`` valid columns are loaded into registers once; the ``topk``-th largest
  key is found bit by bit (count of keys >= a trial value, one reduction per bit below the
  common prefix of the row's smallest and largest key) and the selected columns are compacted
  with one scan.
- Longer rows: a lower bound is taken from ``SAMPLE`` evenly spaced keys (runs of 8 consecutive
  columns): the sampled key whose rank lies ``SIGMAS`` standard deviations above the expected
  rank of the ``topk``-th key, cut to its top 16 bits. The row is streamed once (the next tile's
  load in flight with ``PREFETCH``); keys at or above the bound (at most ``CAP``) are compacted by
  a scan per tile into the program's scratch slab and resolved in registers as above. When the
  bound misses (fewer than ``topk`` or more than ``CAP`` keys above it, e.g. with massive ties)
  the row is resolved by a streaming radix select with 8-bit digits on the full key, stopping
  once the matching bucket holds exactly the number still needed.

Split path (four launches; ``topk`` above ``ROW_MAX_TOPK``):

1. ``_topk_histogram_kernel`` (twice): 256-bin histogram of key bits 31..24, then of bits 23..16
   among the keys whose bits 31..24 are the digit holding the ``topk``-th key; a row is split over
   ``SPLIT`` programs that add their partial histograms with atomics.
2. ``_topk_filter_kernel``: keys whose top 16 bits exceed that 16-bit threshold prefix go straight
   to the output, keys with the prefix to a candidate list (slots reserved with an atomic counter).
3. ``_topk_finish_kernel``: radix select with 8-bit digits on bits 15..0 among the candidates (or
   among the whole row when the prefix overflowed the list), then writes the keys above the
   threshold and the first ``needed`` keys equal to it.

No host synchronisation; temporary buffers are sized by shapes only.

``logical_to_global_indices``: element-wise; ``slot = block_table[req, pos // page] * page +
pos % page``; ``-1`` for negative positions, pages past the table and negative table entries.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _topk_ordered_key(x):
    # float32 -> uint32 whose unsigned order is the float order (xor with all ones rather than ~:
    # Triton 3.8's interpreter evaluates ~ on uint32 through a signed -1 and overflows)
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    return tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)


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


@triton.jit
def _topk_row_start(x_ptr, out_ptr, starts_ptr, ends_ptr, i_r, N, K, stride_x, HAS_STARTS: tl.constexpr,
                    HAS_ENDS: tl.constexpr):
    # window [lo, hi) of row i_r and the row's input and output pointers
    lo, hi = _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS, HAS_ENDS)
    p_x = x_ptr + tl.cast(i_r, tl.int64) * stride_x
    p_out = out_ptr + tl.cast(i_r, tl.int64) * K
    return lo, hi, p_x, p_out


@triton.jit
def _topk_store_all(p_out, lo, n, K, BLOCK: tl.constexpr):
    # a row with n <= K valid columns: all of them in column order, then -1
    o_b = tl.arange(0, BLOCK)
    for j0 in range(0, K, BLOCK):
        o_j = j0 + o_b
        tl.store(p_out + o_j, tl.where(o_j < n, lo + o_j, -1), mask=o_j < K)


@triton.jit
def _topk_kth_key(b_key, m_key, k, LOW: tl.constexpr):
    # the k-th largest masked key (needs k <= masked count) with its lowest LOW bits cleared: the
    # largest t (a multiple of 2**LOW) with at least k masked keys >= t, found bit by bit (one
    # reduction each) below the common prefix of the masked keys' minimum and maximum
    k_min = tl.min(tl.where(m_key, b_key, 0xFFFFFFFF), axis=0)
    k_max = tl.max(tl.where(m_key, b_key, 0), axis=0)
    diff = k_min ^ k_max
    # bits below the common prefix: exponent of diff as a float, + 1 (rounding up only adds a bit)
    nb = tl.where(diff == 0, 0, ((diff.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 126).to(tl.int32))
    nb = tl.maximum(tl.minimum(nb, 32), LOW)
    low = ((tl.full([], 1, tl.uint32) << (tl.maximum(nb, 1) - 1).to(tl.uint32)) - 1) * 2 + 1
    t = tl.where(nb == 0, k_min, k_min & (low ^ 0xFFFFFFFF))
    for i in range(0, nb - LOW):
        c = t | (tl.full([], 1, tl.uint32) << (nb - 1 - i).to(tl.uint32))
        n_ge = tl.sum((m_key & (b_key >= c)).to(tl.int32), axis=0)
        t = tl.where(n_ge >= k, c, t)
    return t


@triton.jit
def _topk_emit(b_key, m_key, b_col, k, p_out):
    # write the columns of the k largest masked keys (k <= masked count < 2**16) to p_out[0, k):
    # keys above the k-th largest, then the first of those equal to it
    t = _topk_kth_key(b_key, m_key, k, 0)
    m_gt = m_key & (b_key > t)
    m_eq = m_key & (b_key == t)
    n_gt = tl.sum(m_gt.to(tl.int32), axis=0)
    # both ranks from one scan: greater-than count in the low 16 bits, equal count above
    b_c = tl.cumsum(m_gt.to(tl.int32) + (m_eq.to(tl.int32) << 16), axis=0)
    c_eq = b_c >> 16
    m_sel = m_gt | (m_eq & (n_gt + c_eq <= k))
    tl.store(p_out + tl.where(m_gt, b_c & 0xFFFF, n_gt + c_eq) - 1, b_col, mask=m_sel)


@triton.jit
def _topk_stream_select(p_x, p_out, lo, hi, K, BLOCK: tl.constexpr):
    # exact top-K of columns [lo, hi) of one row straight from the logits: radix select with 8-bit
    # digits (stopping once the matching bucket holds exactly the number still needed), then
    # keys above the threshold and the first `need` keys equal to it go to the output
    o_b = tl.arange(0, BLOCK)
    o_bin = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    keep = tl.full([], 0, tl.uint32)
    need = K
    shift = tl.full([], 32, tl.uint32)
    go = K > 0
    while go:
        shift -= 8
        b_hist = tl.zeros([256], dtype=tl.int32)
        for t0 in range(lo, hi, BLOCK):
            o_t = t0 + o_b
            m_t = o_t < hi
            b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            m_c = m_t & ((b_key & keep) == prefix)
            b_hist += tl.histogram(tl.where(m_c, ((b_key >> shift) & 0xFF).to(tl.int32), 0), 256)
            b_hist -= tl.where(o_bin == 0, BLOCK - tl.sum(m_c.to(tl.int32), axis=0), 0)
        b_suffix = tl.sum(b_hist, axis=0) - tl.cumsum(b_hist, axis=0) + b_hist
        d = tl.max(tl.where(b_suffix >= need, o_bin, -1), axis=0)
        need -= tl.sum(tl.where(o_bin > d, b_hist, 0), axis=0)
        in_d = tl.sum(tl.where(o_bin == d, b_hist, 0), axis=0)
        prefix |= d.to(tl.uint32) << shift
        keep |= tl.full([], 0xFF, tl.uint32) << shift
        go = (shift > 0) & (in_d != need)
    k_gt = K - need
    n_gt = 0
    n_eq = 0
    for t0 in range(lo, hi, BLOCK):
        o_t = t0 + o_b
        m_t = o_t < hi
        b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_t, other=0.0)) & keep
        m_gt = m_t & (b_key > prefix)
        m_eq = m_t & (b_key == prefix)
        # both ranks from one scan: greater-than count in the low 16 bits, equal count above
        b_c = tl.cumsum(m_gt.to(tl.int32) + (m_eq.to(tl.int32) << 16), axis=0)
        c_gt = b_c & 0xFFFF
        c_eq = b_c >> 16
        tl.store(p_out + n_gt + c_gt - 1, o_t, mask=m_gt)
        r_eq = n_eq + c_eq - 1
        tl.store(p_out + k_gt + r_eq, o_t, mask=m_eq & (r_eq < need))
        n_gt += tl.sum(m_gt.to(tl.int32), axis=0)
        n_eq += tl.sum(m_eq.to(tl.int32), axis=0)


@_row_window_flags
@triton.jit(do_not_specialize=["R", "N", "K"])
def _topk_row_kernel(
    x_ptr,
    out_ptr,
    scratch_ptr,
    starts_ptr,
    ends_ptr,
    R,
    N,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    SIGMAS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # one program selects whole rows i_p, i_p + G, ...; see the module docstring
    i_p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_c = tl.arange(0, CAP)
    o_b = tl.arange(0, BLOCK)
    o_s = tl.arange(0, SAMPLE)
    p_sk = scratch_ptr + i_p.to(tl.int64) * (2 * CAP)  # keys of a long row's candidates
    p_si = p_sk + CAP  # their columns
    for i_r in range(i_p, R, n_prog):
        lo, hi, p_x, p_out = _topk_row_start(x_ptr, out_ptr, starts_ptr, ends_ptr, i_r, N, K, stride_x,
                                             HAS_STARTS, HAS_ENDS)
        n = hi - lo
        if n <= K:
            _topk_store_all(p_out, lo, n, K, BLOCK)
        elif n <= CAP:
            m_c = o_c < n
            b_key = _topk_ordered_key(tl.load(p_x + lo + o_c, mask=m_c, other=0.0))
            _topk_emit(b_key, m_c, lo + o_c, K, p_out)
        else:
            # lower bound: the r-th largest of SAMPLE evenly spaced keys (runs of 8 consecutive
            # columns, one 32-byte sector each), r placed SIGMAS standard deviations above the
            # expected sampled rank r_exp of the K-th key, so that at least K keys lie above it
            o_r = ((o_s // 8).to(tl.int64) * n) // (SAMPLE // 8) + o_s % 8
            b_s = _topk_ordered_key(tl.load(p_x + lo + o_r))
            r_exp = (K * SAMPLE) / n  # K * SAMPLE < 2**24
            r_sd = tl.sqrt(SIGMAS * SIGMAS + 4.0 * r_exp)
            r_lo = tl.minimum(tl.ceil((r_sd + SIGMAS) * (r_sd + SIGMAS) * 0.25).to(tl.int32), SAMPLE)
            t_lo = _topk_kth_key(b_s, o_s >= 0, r_lo, 16)  # a 16-bit bound is close enough
            # one pass over the row: keys >= t_lo to the scratch, compacted by a scan per tile
            n_c = 0
            a0 = (lo // BLOCK) * BLOCK
            b_nx = tl.load(p_x + a0 + o_b, mask=a0 + o_b < hi, other=0.0)
            for t0 in range(a0, hi, BLOCK):
                o_t = t0 + o_b
                m_t = (o_t >= lo) & (o_t < hi)
                if PREFETCH:  # the next tile's load is in flight while this one is processed
                    b_x = b_nx
                    b_nx = tl.load(p_x + o_t + BLOCK, mask=o_t + BLOCK < hi, other=0.0)
                else:
                    b_x = tl.load(p_x + o_t, mask=m_t, other=0.0)
                b_k = _topk_ordered_key(b_x)
                m_k = m_t & (b_k >= t_lo)
                o_w = n_c + tl.cumsum(m_k.to(tl.int32), axis=0) - 1
                m_w = m_k & (o_w < CAP)
                tl.store(p_sk + o_w, b_k.to(tl.int32, bitcast=True), mask=m_w)
                tl.store(p_si + o_w, o_t, mask=m_w)
                n_c += tl.sum(m_k.to(tl.int32), axis=0)
            tl.debug_barrier()  # the scratch written by every thread is read back by others
            if (n_c >= K) & (n_c <= CAP):
                m_c = o_c < n_c
                b_key = tl.load(p_sk + o_c, mask=m_c, other=0).to(tl.uint32, bitcast=True)
                b_col = tl.load(p_si + o_c, mask=m_c, other=0)
                _topk_emit(b_key, m_c, b_col, K, p_out)
            else:  # the bound missed (e.g. massive ties): streaming radix select
                _topk_stream_select(p_x, p_out, lo, hi, K, BLOCK)


@triton.jit
def _topk_resident_threshold(b_key, n, k):
    # b_key: keys of a register-resident row, 0 on lanes outside it; n > k keys in it. Returns t
    # with exactly k keys >= t (stopping early) or, when keys tie, the k-th largest key: the
    # largest t with at least k keys >= t, bit by bit from the top, one reduction per bit (trial
    # values are never 0, so lanes outside the row never count)
    t = tl.full([], 0, tl.uint32)
    n_t = n  # keys >= t
    bit = 31
    while (n_t != k) & (bit >= 0):
        c = t | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
        n_c = tl.sum((b_key >= c).to(tl.int32), axis=0)
        take = n_c >= k
        t = tl.where(take, c, t)
        n_t = tl.where(take, n_c, n_t)
        bit -= 1
    return t


@triton.jit
def _topk_resident_emit(p_x, p_src, p_col, p_key, lo, hi, t, n_gt, K, BLOCK: tl.constexpr,
                        STORE_KEY: tl.constexpr, FROM_LIST: tl.constexpr):
    # read entries [lo, hi) again tile by tile (row columns, or with FROM_LIST the keys p_x[j] and
    # columns p_src[j] of a candidate list): columns (and keys) of the n_gt keys above t to
    # [0, n_gt), the first K - n_gt keys equal to t after them
    o_b = tl.arange(0, BLOCK)
    c_gt = 0
    c_eq = n_gt
    for t0 in range(lo, hi, BLOCK):
        o_t = t0 + o_b
        m_t = o_t < hi
        if FROM_LIST:
            b_key = tl.load(p_x + o_t, mask=m_t, other=0).to(tl.uint32, bitcast=True)
            b_col = tl.load(p_src + o_t, mask=m_t, other=0)
        else:
            b_key = _topk_ordered_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            b_col = o_t
        m_gt = m_t & (b_key > t)
        m_eq = m_t & (b_key == t)
        # both ranks from one scan: greater-than count in the low 16 bits, equal count above
        b_one = m_gt.to(tl.int32) + (m_eq.to(tl.int32) << 16)
        b_c = tl.cumsum(b_one, axis=0)
        o_w = tl.where(m_gt, c_gt + (b_c & 0xFFFF), c_eq + (b_c >> 16)) - 1
        m_w = m_gt | (m_eq & (o_w < K))
        tl.store(p_col + o_w, b_col, mask=m_w)
        if STORE_KEY:
            tl.store(p_key + o_w, b_key.to(tl.int32, bitcast=True), mask=m_w)
        b_n = tl.sum(b_one, axis=0)
        c_gt += b_n & 0xFFFF
        c_eq += b_n >> 16


@_row_window_flags
@triton.jit(do_not_specialize=["R", "N", "K"])
def _topk_resident_kernel(
    x_ptr,
    out_ptr,
    scratch_ptr,
    starts_ptr,
    ends_ptr,
    R,
    N,
    K,
    stride_x,
    CAP: tl.constexpr,
    FIN: tl.constexpr,
    EMIT_BLOCK: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # one program selects whole rows i_p, i_p + G, ...; see the module docstring
    i_p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_c = tl.arange(0, CAP)
    p_sk = scratch_ptr + i_p.to(tl.int64) * (2 * FIN)  # keys of a long row's chunk winners
    p_si = p_sk + FIN  # their columns
    for i_r in range(i_p, R, n_prog):
        lo, hi, p_x, p_out = _topk_row_start(x_ptr, out_ptr, starts_ptr, ends_ptr, i_r, N, K, stride_x,
                                             HAS_STARTS, HAS_ENDS)
        n = hi - lo
        if n <= K:
            _topk_store_all(p_out, lo, n, K, CAP)
        elif n <= CAP:
            m_c = o_c < n
            b_key = tl.where(m_c, _topk_ordered_key(tl.load(p_x + lo + o_c, mask=m_c, other=0.0)), 0)
            t = _topk_resident_threshold(b_key, n, K)
            n_gt = tl.sum((b_key > t).to(tl.int32), axis=0)
            _topk_resident_emit(p_x, p_x, p_out, p_out, lo, hi, t, n_gt, K, EMIT_BLOCK, False, False)
        elif FIN > 0:
            # chunks of CAP columns: the top K of each (keys and columns) to the scratch slab
            n_w = 0
            for c0 in range(lo, hi, CAP):
                n_k = tl.minimum(hi - c0, CAP)
                m_k = o_c < n_k
                b_ck = tl.where(m_k, _topk_ordered_key(tl.load(p_x + c0 + o_c, mask=m_k, other=0.0)), 0)
                if n_k <= K:
                    tl.store(p_sk + n_w + o_c, b_ck.to(tl.int32, bitcast=True), mask=m_k)
                    tl.store(p_si + n_w + o_c, c0 + o_c, mask=m_k)
                else:
                    t_k = _topk_resident_threshold(b_ck, n_k, K)
                    n_gk = tl.sum((b_ck > t_k).to(tl.int32), axis=0)
                    _topk_resident_emit(p_x, p_x, p_si + n_w, p_sk + n_w, c0, c0 + n_k, t_k, n_gk, K,
                                        EMIT_BLOCK, True, False)
                n_w += tl.minimum(n_k, K)
            tl.debug_barrier()  # the scratch written by every thread is read back by others
            # the top K of the n_w <= FIN chunk winners
            o_f = tl.arange(0, FIN)
            m_f = o_f < n_w
            b_fk = tl.load(p_sk + o_f, mask=m_f, other=0).to(tl.uint32, bitcast=True)
            t_f = _topk_resident_threshold(b_fk, n_w, K)
            n_gf = tl.sum((b_fk > t_f).to(tl.int32), axis=0)
            _topk_resident_emit(p_sk, p_si, p_out, p_out, 0, n_w, t_f, n_gf, K, EMIT_BLOCK, False, True)
            tl.debug_barrier()  # the slab is rewritten by the program's next row


@triton.jit
def _topk_add3(a1, a2, a3, b1, b2, b3):
    return a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _topk_digit_step(t, n_t, sh, n1, n2, n3, k):
    # the next 2-bit digit (bits sh + 1, sh) of the largest t' >= t with at least k keys >= t',
    # from the counts n_d of keys >= t | d << sh (d = 1, 2, 3)
    one = tl.full([], 1, tl.uint32) << sh.to(tl.uint32)
    t_new = tl.where(n3 >= k, t | (one * 3), tl.where(n2 >= k, t | (one * 2), tl.where(n1 >= k, t | one, t)))
    n_new = tl.where(n3 >= k, n3, tl.where(n2 >= k, n2, tl.where(n1 >= k, n1, n_t)))
    return t_new, n_new


@triton.jit
def _topk_list_threshold(p_key, n_c, K, t_lo, k_max, BLOCK: tl.constexpr):
    # keys p_key[0, n_c) (n_c >= K, every key in [t_lo, k_max]): t with exactly K keys >= t
    # (stopping early) or, when keys tie, the K-th largest key, found two bits per pass over the
    # list below the common prefix of t_lo and k_max (counts kept per lane, one reduction per
    # pass); returns (t, keys > t)
    o_b = tl.arange(0, BLOCK)
    diff = t_lo ^ k_max
    # bits below the common prefix: exponent of diff as a float, + 1 (rounding up only adds a bit),
    # made even (a prefix bit searched again changes nothing)
    nb = tl.where(diff == 0, 0, ((diff.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 126).to(tl.int32))
    nb = tl.minimum(nb + (nb & 1), 32)
    low = ((tl.full([], 1, tl.uint32) << (tl.maximum(nb, 1) - 1).to(tl.uint32)) - 1) * 2 + 1
    t = tl.where(nb == 0, t_lo, t_lo & (low ^ 0xFFFFFFFF))
    n_t = n_c  # keys >= t
    sh = nb - 2  # lowest bit of the next digit
    while (n_t != K) & (sh >= 0):
        one = tl.full([], 1, tl.uint32) << sh.to(tl.uint32)
        # per lane, the three counts in 10-bit fields (at most one per tile: CAP < 1024 tiles)
        b_n = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, n_c, BLOCK):
            o_j = j0 + o_b
            # lanes past the list read key 0, below every trial value
            b_k = tl.load(p_key + o_j, mask=o_j < n_c, other=0).to(tl.uint32, bitcast=True)
            b_n += (tl.where(b_k >= (t | one), 1, 0) + tl.where(b_k >= (t | (one * 2)), 1 << 10, 0)
                    + tl.where(b_k >= (t | (one * 3)), 1 << 20, 0))
        b_n64 = b_n.to(tl.int64)
        n_all = tl.sum((b_n64 & 0x3FF) + ((b_n64 & 0xFFC00) << 11) + ((b_n64 >> 20) << 42), axis=0)
        n1 = (n_all & 0x1FFFFF).to(tl.int32)
        n2 = ((n_all >> 21) & 0x1FFFFF).to(tl.int32)
        n3 = (n_all >> 42).to(tl.int32)
        t, n_t = _topk_digit_step(t, n_t, sh, n1, n2, n3, K)
        sh -= 2
    b_gt = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, n_c, BLOCK):
        o_j = j0 + o_b
        b_k = tl.load(p_key + o_j, mask=o_j < n_c, other=0).to(tl.uint32, bitcast=True)
        b_gt += ((o_j < n_c) & (b_k > t)).to(tl.int32)
    return t, tl.sum(b_gt, axis=0)


@triton.jit
def _topk_sieve_tile(b_x, o_t, s_lo, s_hi, t_lo, n_c, b_mx, p_sk, p_si, p_cnt, CAP: tl.constexpr,
                     MASKED: tl.constexpr, ATOMIC: tl.constexpr):
    # keys >= t_lo of one tile (columns o_t; with MASKED only those in [s_lo, s_hi)) appended to
    # the list at n_c, or with ATOMIC at a position reserved on the row's counter p_cnt (entries
    # past CAP dropped); returns the keys seen so far and the running maximum
    b_k = _topk_ordered_key(b_x)
    m_k = b_k >= t_lo
    if MASKED:
        m_k = m_k & (o_t >= s_lo) & (o_t < s_hi)
    b_mx = tl.maximum(b_mx, tl.where(m_k, b_k, 0))
    n_k = tl.sum(m_k.to(tl.int32), axis=0)
    base = n_c
    if ATOMIC:
        base = tl.atomic_add(p_cnt, n_k, sem="relaxed")
    o_w = base + tl.cumsum(m_k.to(tl.int32), axis=0) - 1
    m_w = m_k & (o_w < CAP)
    tl.store(p_sk + o_w, b_k.to(tl.int32, bitcast=True), mask=m_w)
    tl.store(p_si + o_w, o_t, mask=m_w)
    return n_c + n_k, b_mx


@triton.jit
def _topk_sieve_span(p_x, s_lo, s_hi, t_lo, p_sk, p_si, p_cnt, BLOCK: tl.constexpr, CAP: tl.constexpr,
                     ATOMIC: tl.constexpr):
    # one pass over columns [s_lo, s_hi) appending the keys >= t_lo to the list (compacted by a
    # scan per tile); tiles aligned to BLOCK columns, the full ones read unmasked (vector loads)
    # with the next tile's load in flight. Returns (keys appended, their maximum)
    o_b = tl.arange(0, BLOCK)
    n_c = 0
    b_mx = tl.zeros([BLOCK], dtype=tl.uint32)
    a0 = tl.multiple_of((s_lo // BLOCK) * BLOCK, BLOCK)
    e0 = tl.multiple_of((s_hi // BLOCK) * BLOCK, BLOCK)  # tiles [a0 + BLOCK, e0) are full
    o_t = a0 + o_b
    b_x = tl.load(p_x + o_t, mask=(o_t >= s_lo) & (o_t < s_hi), other=0.0)
    n_c, b_mx = _topk_sieve_tile(b_x, o_t, s_lo, s_hi, t_lo, n_c, b_mx, p_sk, p_si, p_cnt, CAP, True, ATOMIC)
    if e0 > a0 + BLOCK:
        b_nx = tl.load(p_x + a0 + BLOCK + o_b)
        for t0 in range(a0 + BLOCK, e0, BLOCK):
            b_x = b_nx
            b_nx = tl.load(p_x + tl.minimum(t0 + BLOCK, e0 - BLOCK) + o_b)
            n_c, b_mx = _topk_sieve_tile(b_x, t0 + o_b, s_lo, s_hi, t_lo, n_c, b_mx, p_sk, p_si, p_cnt, CAP,
                                         False, ATOMIC)
    if (e0 > a0) & (e0 < s_hi):
        o_t = e0 + o_b
        b_x = tl.load(p_x + o_t, mask=o_t < s_hi, other=0.0)
        n_c, b_mx = _topk_sieve_tile(b_x, o_t, s_lo, s_hi, t_lo, n_c, b_mx, p_sk, p_si, p_cnt, CAP, True,
                                     ATOMIC)
    return n_c, tl.max(b_mx, axis=0)


@triton.jit
def _topk_sieve_finish(p_x, p_out, p_sk, p_si, lo, hi, n_c, t_lo, k_max, K, BLOCK: tl.constexpr,
                       LIST_BLOCK: tl.constexpr, CAP: tl.constexpr):
    # the selection from the list of n_c candidates (all in [t_lo, k_max]), or, when the bound
    # missed (fewer than K or more than CAP candidates, e.g. massive ties), by a streaming radix
    # select over the row
    if (n_c >= K) & (n_c <= CAP):
        t, n_gt = _topk_list_threshold(p_sk, n_c, K, t_lo, k_max, LIST_BLOCK)
        _topk_resident_emit(p_sk, p_si, p_out, p_out, 0, n_c, t, n_gt, K, LIST_BLOCK, False, True)
    else:
        _topk_stream_select(p_x, p_out, lo, hi, K, BLOCK)


@triton.jit
def _topk_sample_bound(p_x, lo, hi, K, SAMPLE: tl.constexpr, SIGMAS: tl.constexpr):
    # lower bound of the K-th largest key of columns [lo, hi) (hi - lo >= SAMPLE >= 16): the r_lo-th
    # largest of SAMPLE keys in evenly spaced runs of 8 columns (run starts aligned to 8 columns and
    # kept inside the window, for vector loads), r_lo SIGMAS standard deviations above the expected
    # sampled rank of the K-th key, cut to its top 16 bits
    n = hi - lo
    o_j = tl.arange(0, SAMPLE // 8)
    o_e = tl.arange(0, 8)
    o_run = ((lo + (o_j.to(tl.int64) * n) // (SAMPLE // 8)) // 8) * 8
    o_run = tl.minimum(tl.maximum(o_run, ((lo + 7) // 8) * 8), (hi // 8) * 8 - 8)
    o_r = tl.multiple_of(o_run, 8)[:, None] + o_e[None, :]  # [SAMPLE // 8, 8]
    b_s = _topk_ordered_key(tl.load(p_x + o_r))
    r_exp = (K * SAMPLE) / n  # K * SAMPLE < 2**24
    r_sd = tl.sqrt(SIGMAS * SIGMAS + 4.0 * r_exp)
    r_lo = tl.minimum(tl.ceil((r_sd + SIGMAS) * (r_sd + SIGMAS) * 0.25).to(tl.int32), SAMPLE)
    # the top 16 bits, two per step
    t = tl.full([], 0, tl.uint32)
    n_t = 0
    for i in range(8):
        sh = tl.full([], 30 - 2 * i, tl.int32)
        one = tl.full([], 1, tl.uint32) << sh.to(tl.uint32)
        b_n = tl.reduce(((b_s >= (t | one)).to(tl.int32), (b_s >= (t | (one * 2))).to(tl.int32),
                         (b_s >= (t | (one * 3))).to(tl.int32)), 1, _topk_add3)
        n1, n2, n3 = tl.reduce(b_n, 0, _topk_add3)
        t, n_t = _topk_digit_step(t, n_t, sh, n1, n2, n3, r_lo)
    return t


@_row_window_flags
@triton.jit(do_not_specialize=["R", "N", "K"])
def _topk_sieve_kernel(
    x_ptr,
    out_ptr,
    scratch_ptr,
    starts_ptr,
    ends_ptr,
    R,
    N,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    LIST_BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    DIRECT: tl.constexpr,
    SIGMAS: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # one program selects whole rows i_p, i_p + G, ...: a lower bound from a sample, one pass
    # keeping the keys at or above it in the program's scratch list, then the threshold and the
    # selection from that list; see the module docstring
    i_p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    p_sk = scratch_ptr + i_p.to(tl.int64) * (2 * CAP)  # keys of the row's candidates
    p_si = p_sk + CAP  # their columns
    for i_r in range(i_p, R, n_prog):
        lo, hi, p_x, p_out = _topk_row_start(x_ptr, out_ptr, starts_ptr, ends_ptr, i_r, N, K, stride_x,
                                             HAS_STARTS, HAS_ENDS)
        n = hi - lo
        if n <= K:
            _topk_store_all(p_out, lo, n, K, BLOCK)
        else:
            t_lo = tl.full([], 0, tl.uint32)  # rows of at most DIRECT columns keep every key
            if n > DIRECT:
                t_lo = _topk_sample_bound(p_x, lo, hi, K, SAMPLE, SIGMAS)
            n_c, k_max = _topk_sieve_span(p_x, lo, hi, t_lo, p_sk, p_si, p_sk, BLOCK, CAP, False)
            tl.debug_barrier()  # the list written by every thread is read back by others
            _topk_sieve_finish(p_x, p_out, p_sk, p_si, lo, hi, n_c, t_lo, k_max, K, BLOCK, LIST_BLOCK, CAP)
        tl.debug_barrier()  # the list is rewritten by the program's next row


@_row_window_flags
@triton.jit(do_not_specialize=["N", "K"])
def _topk_sieve_part_kernel(
    x_ptr,
    scratch_ptr,
    state_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    DIRECT: tl.constexpr,
    SIGMAS: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # program (i_r, i_s): part i_s of row i_r (whole tiles of BLOCK columns) appended to the row's
    # list; every part computes the same bound. State per row: list length, maximum key >> 1, bound
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    n_split = tl.num_programs(1)
    lo, hi = _topk_row_window(starts_ptr, ends_ptr, i_r, N, HAS_STARTS, HAS_ENDS)
    n = hi - lo
    if n > K:
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        p_sk = scratch_ptr + i_r.to(tl.int64) * (2 * CAP)
        p_st = state_ptr + i_r * 4
        t_lo = tl.full([], 0, tl.uint32)  # rows of at most DIRECT columns keep every key
        if n > DIRECT:
            t_lo = _topk_sample_bound(p_x, lo, hi, K, SAMPLE, SIGMAS)
        a0 = (lo // BLOCK) * BLOCK
        per = tl.cdiv(tl.cdiv(hi - a0, BLOCK), n_split) * BLOCK
        s_lo = tl.maximum(lo, a0 + i_s * per)
        s_hi = tl.minimum(hi, a0 + (i_s + 1) * per)
        if s_lo < s_hi:
            _, k_max = _topk_sieve_span(p_x, s_lo, s_hi, t_lo, p_sk, p_sk + CAP, p_st, BLOCK, CAP, True)
            tl.atomic_max(p_st + 1, (k_max >> 1).to(tl.int32), sem="relaxed")
        if i_s == 0:
            tl.store(p_st + 2, t_lo.to(tl.int32, bitcast=True))


@_row_window_flags
@triton.jit(do_not_specialize=["N", "K"])
def _topk_sieve_merge_kernel(
    x_ptr,
    out_ptr,
    scratch_ptr,
    state_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
):
    # row i_r: the selection from the list its parts wrote
    i_r = tl.program_id(0)
    lo, hi, p_x, p_out = _topk_row_start(x_ptr, out_ptr, starts_ptr, ends_ptr, i_r, N, K, stride_x,
                                         HAS_STARTS, HAS_ENDS)
    n = hi - lo
    if n <= K:
        _topk_store_all(p_out, lo, n, K, BLOCK)
    else:
        p_sk = scratch_ptr + i_r.to(tl.int64) * (2 * CAP)
        p_st = state_ptr + i_r * 4
        n_c = tl.load(p_st)
        k_max = (tl.load(p_st + 1).to(tl.uint32, bitcast=True) << 1) | 1
        t_lo = tl.load(p_st + 2).to(tl.uint32, bitcast=True)
        _topk_sieve_finish(p_x, p_out, p_sk, p_sk + CAP, lo, hi, n_c, t_lo, k_max, K, BLOCK, BLOCK, CAP)


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
