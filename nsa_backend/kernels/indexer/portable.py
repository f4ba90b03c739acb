"""Portable Triton (``tl``) kernels of the lightning indexer: ragged (prefill) and paged (decode) fp8 MQA logits.

    logits[i, n] = k_scale[n] * sum_h relu(q[i, h] . k[n]) * w[i, h]

Layouts (row-major):

- ragged: ``q [S, H, D]`` e4m3, ``k [N, D]`` e4m3, ``k_scale [N]`` f32, ``w [S, H]`` f32,
  ``ks / ke [S]`` i32; out ``[S, N]`` (or ``[S, max_seqlen_k]`` compressed) f32.
- paged: ``q [B, next_n, H, D]``, ``w [B * next_n, H]``; cache ``u8 [P, PAGE, 1, D + 4]`` where
  page ``p`` starts at byte ``p * stride_page`` and holds ``PAGE * D`` e4m3 values (token-major)
  followed by ``PAGE`` f32 scales; ``block_table [B, M]`` i32; out ``[B * next_n, max_ctx]`` f32.

Both kernels compute ``S^T = K @ Q^T``: a tile of ``BLOCK_N`` keys (MMA M) against ``BQ * HP``
query columns (MMA N; heads padded to ``HP`` with zero weights). After relu and the weights, the
accumulator is viewed as ``[BLOCK_N, BQ, HP]`` and summed over heads, which stays inside warps.
Architectures without fp8 MMA (sm_80 / sm_86) read the fp8 bytes as ``uint8`` and decode them to
fp16 in registers (``FP8_NATIVE=False``): the fp16 value is ``x / 256`` exactly, so the weights
carry a factor ``2**16``.

The paged kernel ignores ``schedule_meta``: its grid is ``(B * row groups, cdiv(max_context_len,
CHUNK))``, fixed by shapes only, so the call has no host synchronisation and can be captured in a
graph. A program reads each page once for all ``NP`` rows of its group (all ``next_n`` rows
unless the query tile would not fit the architecture's shared memory). Decode is bound by the
bytes of the cache, so its loop keeps the key tile an MMA operand in shared memory (the fp8
values are loaded through a typed pointer, not bitcast after the load), looks up one page id per
tile when a tile is a whole page, and loads the scales (which the compiler does not pipeline) a
tile ahead in registers. Options selected by the launch configuration:

- ``ROW_LOOP``: the ``NP`` rows take turns on each key tile (one ``[BLOCK_N, HP]`` MMA per row),
  so one row's accumulator is live instead of ``[BLOCK_N, NP * HP]`` (fewer registers, more
  programs per SM); the key tile is still read once.
- ``HEAD_SLICES=2`` (with ``ROW_LOOP``, ``HP >= 32``): each row's heads are multiplied as two products of
  ``HP / 2`` heads. Triton lays the warps of a 64 x 64 product out 2 x 2, so each key's head sum crosses
  warps through shared memory; a 64 x 32 product puts the four warps along the keys only, and the sum stays
  in each warp (sm_120, 64 heads, one row: 308 instructions and 3 barriers per tile against 329 and 5).
- ``PG_AHEAD`` (one-page tiles): the block-table entry of the scales is read one tile before the
  scales, so that load's latency is off the loop's path.
- ``K_MASK=False``: key loads are not masked; every address stays inside the cache (invalid pages
  read page 0, keys past a context read other rows of their page) and those keys' logits are set
  to ``-inf`` after the MMA (a key row only affects its own logit).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2**8 per operand: fp16 bits built from e4m3 bits are the value divided by 256.
DECODE_SCALE = 65536.0


@triton.jit
def _indexer_e4m3_bits_to_f16(x):
    # x: uint8 e4m3 bits -> fp16 holding value / 256 (exact, subnormals included)
    x16 = x.to(tl.uint16)
    bits = ((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True)


@triton.heuristics({"COMPRESSED": lambda args: args["max_seqlen_k"] > 0})
@triton.jit
def _indexer_ragged_logits_kernel(
    q_ptr,
    k_ptr,
    k_scale_ptr,
    w_ptr,
    ks_ptr,
    ke_ptr,
    out_ptr,
    S,
    N,
    H,
    stride_out,
    max_seqlen_k,
    w_scale,
    D: tl.constexpr,
    HP: tl.constexpr,
    BQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CLEAN: tl.constexpr,
    COMPRESSED: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    i_q = tl.program_id(0)
    o_q = i_q * BQ + tl.arange(0, BQ)
    m_q = o_q < S
    b_ks = tl.maximum(tl.load(ks_ptr + o_q, mask=m_q, other=0), 0)
    b_ke = tl.minimum(tl.load(ke_ptr + o_q, mask=m_q, other=0), N)
    m_live = m_q & (b_ke > b_ks)
    # union of the windows of this program's rows, in whole tiles
    lo = tl.min(tl.where(m_live, b_ks, N), axis=0)
    hi = tl.max(tl.where(m_live, b_ke, 0), axis=0)
    live = hi > lo
    lo = tl.where(live, lo // BLOCK_N * BLOCK_N, 0)
    hi = tl.where(live, hi, 0)

    o_c = tl.arange(0, BQ * HP)
    o_d = tl.arange(0, D)
    o_cq = i_q * BQ + o_c // HP
    o_ch = o_c % HP
    m_c = (o_cq < S) & (o_ch < H)
    o_qh = o_cq.to(tl.int64) * H + o_ch
    b_q = tl.load(q_ptr + o_qh[:, None] * D + o_d[None, :], mask=m_c[:, None], other=0.0)  # [BQ*HP, D]
    b_w = tl.load(w_ptr + o_qh, mask=m_c, other=0.0) * w_scale  # [BQ*HP]
    if not FP8_NATIVE:
        b_q = _indexer_e4m3_bits_to_f16(b_q)
    p_out = out_ptr + o_q.to(tl.int64)[None, :] * stride_out  # [1, BQ]

    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        b_k = tl.load(k_ptr + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_sc = tl.load(k_scale_ptr + o_n, mask=m_n, other=0.0)
        if not FP8_NATIVE:
            b_k = _indexer_e4m3_bits_to_f16(b_k)
        b_s = tl.dot(b_k, tl.trans(b_q))  # [BLOCK_N, BQ*HP]
        b_s = tl.maximum(b_s, 0.0) * b_w[None, :]
        b_l = tl.sum(tl.reshape(b_s, (BLOCK_N, BQ, HP)), axis=2)  # [BLOCK_N, BQ]
        b_l = b_l * b_sc[:, None]
        m_in = (o_n[:, None] >= b_ks[None, :]) & (o_n[:, None] < b_ke[None, :])  # [BLOCK_N, BQ]
        if COMPRESSED:
            o_j = o_n[:, None] - b_ks[None, :]
            tl.store(p_out + o_j, b_l, mask=m_in & m_q[None, :] & (o_j < max_seqlen_k))
        else:
            if CLEAN:
                b_l = tl.where(m_in, b_l, float("-inf"))
            tl.store(p_out + o_n[:, None], b_l, mask=m_q[None, :] & (o_n < N)[:, None])

    if CLEAN:
        b_inf = tl.full([BLOCK_N, BQ], float("-inf"), tl.float32)
        if COMPRESSED:
            # row i holds ke[i] - ks[i] values; the rest of its max_seqlen_k columns is -inf
            b_len = tl.where(m_live, b_ke - b_ks, 0)
            j0 = tl.min(tl.where(m_q, b_len, max_seqlen_k), axis=0) // BLOCK_N * BLOCK_N
            for j in range(j0, max_seqlen_k, BLOCK_N):
                o_j = j + tl.arange(0, BLOCK_N)
                m_j = (o_j[:, None] >= b_len[None, :]) & (o_j < max_seqlen_k)[:, None] & m_q[None, :]
                tl.store(p_out + o_j[:, None], b_inf, mask=m_j)
        else:
            # tiles left of and right of the union window
            hi_fill = tl.cdiv(hi, BLOCK_N) * BLOCK_N
            for n0 in range(0, lo, BLOCK_N):
                o_n = n0 + tl.arange(0, BLOCK_N)
                tl.store(p_out + o_n[:, None], b_inf, mask=m_q[None, :] & (o_n < N)[:, None])
            for n0 in range(hi_fill, N, BLOCK_N):
                o_n = n0 + tl.arange(0, BLOCK_N)
                tl.store(p_out + o_n[:, None], b_inf, mask=m_q[None, :] & (o_n < N)[:, None])


@triton.jit
def _indexer_paged_keys(p_bt, t0, hi, num_pages, max_blocks, stride_page, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    # keys [t0, t0 + BLOCK_N): byte offset of each key's page (0 where masked), its row in the page,
    # and the mask of keys below hi on a valid page
    o_t = t0 + tl.arange(0, BLOCK_N)
    m_t = o_t < hi
    if BLOCK_N == PAGE:
        # t0 is a multiple of PAGE: one page id per tile (the clamp keeps the read inside the row)
        i_pg = tl.load(p_bt + tl.minimum(t0 // PAGE, max_blocks - 1))
        o_pg = tl.where((i_pg >= 0) & (i_pg < num_pages), i_pg, 0).to(tl.int64) * stride_page
        i_pg = i_pg + tl.zeros([BLOCK_N], dtype=tl.int32)  # [BLOCK_N] (vector masks)
        m_pg = m_t & (i_pg >= 0) & (i_pg < num_pages)
        o_in = tl.arange(0, BLOCK_N)
    else:
        i_pg = tl.load(p_bt + o_t // PAGE, mask=m_t, other=-1)
        m_pg = m_t & (i_pg >= 0) & (i_pg < num_pages)
        o_pg = tl.where(m_pg, i_pg, 0).to(tl.int64) * stride_page
        o_in = o_t % PAGE
    return o_pg, o_in, m_pg


@triton.jit
def _indexer_paged_scale_load(p_sc, m_pg, SCALE_ALIGNED: tl.constexpr):
    # fp32 scales at byte pointers p_sc (0 where masked), byte-wise when pages are not 4-byte aligned
    if SCALE_ALIGNED:
        b_sc = tl.load(p_sc.to(tl.pointer_type(tl.float32)), mask=m_pg, other=0.0)
    else:
        b_sc = tl.load(p_sc, mask=m_pg, other=0).to(tl.uint32)
        b_sc |= tl.load(p_sc + 1, mask=m_pg, other=0).to(tl.uint32) << 8
        b_sc |= tl.load(p_sc + 2, mask=m_pg, other=0).to(tl.uint32) << 16
        b_sc |= tl.load(p_sc + 3, mask=m_pg, other=0).to(tl.uint32) << 24
        b_sc = b_sc.to(tl.float32, bitcast=True)
    return b_sc


@triton.jit
def _indexer_paged_scales(kv_ptr, p_bt, t0, hi, num_pages, max_blocks, stride_page, D: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_ALIGNED: tl.constexpr):
    # fp32 scales of keys [t0, t0 + BLOCK_N) (0 where masked) and the valid-key mask
    o_pg, o_in, m_pg = _indexer_paged_keys(p_bt, t0, hi, num_pages, max_blocks, stride_page, PAGE, BLOCK_N)
    b_sc = _indexer_paged_scale_load(kv_ptr + o_pg + PAGE * D + o_in * 4, m_pg, SCALE_ALIGNED)
    return b_sc, m_pg


@triton.jit
def _indexer_paged_page_scales(kv_ptr, i_pg, t0, hi, num_pages, stride_page, D: tl.constexpr,
                               PAGE: tl.constexpr, SCALE_ALIGNED: tl.constexpr):
    # scales and valid-key mask of the one-page tile [t0, t0 + PAGE) on page i_pg (a block-table
    # entry loaded a tile earlier, so its latency is not on the loop's path)
    o_in = tl.arange(0, PAGE)
    i_pg = i_pg + tl.zeros([PAGE], dtype=tl.int32)
    m_ok = (i_pg >= 0) & (i_pg < num_pages)
    m_pg = m_ok & (t0 + o_in < hi)
    o_pg = tl.where(m_ok, i_pg, 0).to(tl.int64) * stride_page
    b_sc = _indexer_paged_scale_load(kv_ptr + o_pg + PAGE * D + o_in * 4, m_pg, SCALE_ALIGNED)
    return b_sc, m_pg


@triton.jit
def _indexer_paged_query(q_ptr, w_ptr, i_b, j, NEXT_N, H, w_scale, h0, D: tl.constexpr, HP: tl.constexpr,
                         FP8_NATIVE: tl.constexpr):
    # heads [h0, h0 + HP) of query row j of request i_b: [HP, D] tile and [HP] weights (zero for padded
    # heads and rows)
    o_h = h0 + tl.arange(0, HP)
    o_d = tl.arange(0, D)
    m_h = (o_h < H) & ((o_h * 0 + j) < NEXT_N)
    o_qh = (i_b * NEXT_N + j).to(tl.int64) * H + o_h
    b_q = tl.load(q_ptr + o_qh[:, None] * D + o_d[None, :], mask=m_h[:, None], other=0.0)  # [HP, D]
    b_w = tl.load(w_ptr + o_qh, mask=m_h, other=0.0) * w_scale  # [HP]
    if not FP8_NATIVE:
        b_q = _indexer_e4m3_bits_to_f16(b_q)
    return b_q, b_w


@triton.jit
def _indexer_paged_visible(ctx_ptr, i_b, j, NEXT_N, max_ctx, CTX_2D: tl.constexpr):
    # keys visible to row j of request i_b (0 for a padded row)
    if CTX_2D:
        vis = tl.load(ctx_ptr + i_b.to(tl.int64) * NEXT_N + tl.minimum(j, NEXT_N - 1))
    else:
        vis = tl.load(ctx_ptr + i_b) - NEXT_N + 1 + j
    return tl.where(j < NEXT_N, tl.minimum(tl.maximum(vis, 0), max_ctx), 0)


@triton.jit
def _indexer_paged_head_sum(b_k, b_q, b_w):
    # sum over the heads of b_q [HS, D] of relu(k . q) * w: [BLOCK_N]
    b_s = tl.dot(b_k, tl.trans(b_q))  # [BLOCK_N, HS]
    return tl.sum(tl.maximum(b_s, 0.0) * b_w[None, :], axis=1)


@triton.jit
def _indexer_paged_query_slices(q_ptr, w_ptr, i_b, j, NEXT_N, H, w_scale, D: tl.constexpr, HP: tl.constexpr,
                                HEAD_SLICES: tl.constexpr, FP8_NATIVE: tl.constexpr):
    # query row j as HEAD_SLICES (1 or 2) tiles of HP // HEAD_SLICES heads: (q_a, w_a, q_b, w_b); with one
    # slice q_b / w_b repeat q_a / w_a and are not used
    b_qa, b_wa = _indexer_paged_query(q_ptr, w_ptr, i_b, j, NEXT_N, H, w_scale, 0, D, HP // HEAD_SLICES,
                                      FP8_NATIVE)
    if HEAD_SLICES == 2:
        b_qb, b_wb = _indexer_paged_query(q_ptr, w_ptr, i_b, j, NEXT_N, H, w_scale, HP // 2, D, HP // 2,
                                          FP8_NATIVE)
    else:
        b_qb = b_qa
        b_wb = b_wa
    return b_qa, b_wa, b_qb, b_wb


@triton.jit
def _indexer_paged_row(b_k, b_qa, b_wa, b_qb, b_wb, b_sc, m_pg, o_t, vis, p_row, j, NEXT_N, c1,
                       HEAD_SLICES: tl.constexpr):
    # logits of query row j against one key tile: [BLOCK_N] stored at p_row + o_t. Two head slices make
    # two [BLOCK_N, HP / 2] products, which Triton spreads over the warps along the keys only: each
    # key's head sum then stays inside one warp (one [BLOCK_N, HP] product of 64 x 64 puts the warps
    # 2 x 2 and sums across warps through shared memory)
    b_l = _indexer_paged_head_sum(b_k, b_qa, b_wa)
    if HEAD_SLICES == 2:
        b_l += _indexer_paged_head_sum(b_k, b_qb, b_wb)
    b_l = b_l * b_sc  # [BLOCK_N]
    b_l = tl.where((o_t >= vis) | (~m_pg), float("-inf"), b_l)
    tl.store(p_row + o_t, b_l, mask=(o_t < c1) & ((o_t * 0 + j) < NEXT_N))


@triton.jit
def _indexer_paged_logits_kernel(
    q_ptr,
    kv_ptr,
    w_ptr,
    ctx_ptr,
    bt_ptr,
    out_ptr,
    H,
    max_ctx,
    num_pages,
    max_blocks,
    stride_bt,
    stride_page,
    stride_out,
    w_scale,
    NEXT_N,
    CHUNK,
    NP: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CTX_2D: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    SCALE_ALIGNED: tl.constexpr,
    SC_AHEAD: tl.constexpr,
    ROW_LOOP: tl.constexpr,
    PG_AHEAD: tl.constexpr,
    K_MASK: tl.constexpr,
    HEAD_SLICES: tl.constexpr,
):
    # program (i_bg, i_c): rows [j0, j0 + NP) of request i_b, keys [i_c * CHUNK, (i_c + 1) * CHUNK)
    i_bg = tl.program_id(0)
    i_c = tl.program_id(1)
    n_groups = tl.cdiv(NEXT_N, NP)
    i_b = i_bg // n_groups
    o_j = (i_bg % n_groups) * NP + tl.arange(0, NP)
    m_j = o_j < NEXT_N
    # keys visible to each of the request's rows
    if CTX_2D:
        b_vis = tl.load(ctx_ptr + i_b.to(tl.int64) * NEXT_N + o_j, mask=m_j, other=0)
    else:
        b_vis = tl.load(ctx_ptr + i_b) - NEXT_N + 1 + o_j
    b_vis = tl.where(m_j, tl.minimum(tl.maximum(b_vis, 0), max_ctx), 0)  # [NP]
    kmax = tl.minimum(tl.max(b_vis, axis=0), max_blocks * PAGE)
    c0 = i_c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, max_ctx)
    hi = tl.minimum(c1, kmax)

    o_d = tl.arange(0, D)
    if ROW_LOOP:
        # one [HP, D] query tile per row (NP <= 4): the rows take turns on each key tile, so only one
        # row's [BLOCK_N, HP] accumulator is live at a time
        j0 = (i_bg % n_groups) * NP
        b_q0, b_w0, b_q0b, b_w0b = _indexer_paged_query_slices(
            q_ptr, w_ptr, i_b, j0, NEXT_N, H, w_scale, D, HP, HEAD_SLICES, FP8_NATIVE)
        vis0 = _indexer_paged_visible(ctx_ptr, i_b, j0, NEXT_N, max_ctx, CTX_2D)
        p_row0 = out_ptr + (i_b * NEXT_N + j0).to(tl.int64) * stride_out
        if NP >= 2:
            b_q1, b_w1, b_q1b, b_w1b = _indexer_paged_query_slices(
                q_ptr, w_ptr, i_b, j0 + 1, NEXT_N, H, w_scale, D, HP, HEAD_SLICES, FP8_NATIVE)
            vis1 = _indexer_paged_visible(ctx_ptr, i_b, j0 + 1, NEXT_N, max_ctx, CTX_2D)
            p_row1 = p_row0 + stride_out
        if NP >= 4:
            b_q2, b_w2, b_q2b, b_w2b = _indexer_paged_query_slices(
                q_ptr, w_ptr, i_b, j0 + 2, NEXT_N, H, w_scale, D, HP, HEAD_SLICES, FP8_NATIVE)
            vis2 = _indexer_paged_visible(ctx_ptr, i_b, j0 + 2, NEXT_N, max_ctx, CTX_2D)
            p_row2 = p_row1 + stride_out
            b_q3, b_w3, b_q3b, b_w3b = _indexer_paged_query_slices(
                q_ptr, w_ptr, i_b, j0 + 3, NEXT_N, H, w_scale, D, HP, HEAD_SLICES, FP8_NATIVE)
            vis3 = _indexer_paged_visible(ctx_ptr, i_b, j0 + 3, NEXT_N, max_ctx, CTX_2D)
            p_row3 = p_row2 + stride_out
    else:
        o_c = tl.arange(0, NP * HP)
        o_cj = (i_bg % n_groups) * NP + o_c // HP
        o_ch = o_c % HP
        m_c = (o_cj < NEXT_N) & (o_ch < H)
        o_qh = (i_b * NEXT_N + o_cj).to(tl.int64) * H + o_ch
        b_q = tl.load(q_ptr + o_qh[:, None] * D + o_d[None, :], mask=m_c[:, None], other=0.0)  # [NP*HP, D]
        b_w = tl.load(w_ptr + o_qh, mask=m_c, other=0.0) * w_scale  # [NP*HP]
        if not FP8_NATIVE:
            b_q = _indexer_e4m3_bits_to_f16(b_q)
    p_out = out_ptr + (i_b * NEXT_N + o_j).to(tl.int64)[None, :] * stride_out  # [1, NP]
    p_bt = bt_ptr + i_b.to(tl.int64) * stride_bt

    if SC_AHEAD:
        # scales (not an MMA operand, so not pipelined by the compiler) are loaded a tile ahead
        if PG_AHEAD:
            # one-page tiles: the block-table entry of the scales is read one more tile ahead
            i_pg_next = tl.load(p_bt + tl.minimum(c0 // PAGE, max_blocks - 1))
            b_sc_next, m_pg_next = _indexer_paged_page_scales(kv_ptr, i_pg_next, c0, hi, num_pages,
                                                              stride_page, D, PAGE, SCALE_ALIGNED)
            i_pg_next = tl.load(p_bt + tl.minimum(c0 // PAGE + 1, max_blocks - 1))
        else:
            b_sc_next, m_pg_next = _indexer_paged_scales(kv_ptr, p_bt, c0, hi, num_pages, max_blocks,
                                                         stride_page, D, PAGE, BLOCK_N, SCALE_ALIGNED)
    for t0 in range(c0, hi, BLOCK_N):
        o_t = t0 + tl.arange(0, BLOCK_N)
        o_pg, o_in, m_k = _indexer_paged_keys(p_bt, t0, hi, num_pages, max_blocks, stride_page, PAGE, BLOCK_N)
        p_k = kv_ptr + (o_pg + o_in * D)[:, None] + o_d[None, :]  # [BLOCK_N, D]
        if FP8_NATIVE:
            # a typed load (not a bitcast of loaded bytes) keeps the tile an MMA operand in shared memory
            if K_MASK:
                b_k = tl.load(p_k.to(tl.pointer_type(tl.float8e4nv)), mask=m_k[:, None], other=0.0)
            else:
                # every key address lies inside the cache (invalid pages read page 0, keys past the
                # context read their page's other rows): their logits are replaced by -inf below
                b_k = tl.load(p_k.to(tl.pointer_type(tl.float8e4nv)))
        else:
            if K_MASK:
                b_k = _indexer_e4m3_bits_to_f16(tl.load(p_k, mask=m_k[:, None], other=0))
            else:
                b_k = _indexer_e4m3_bits_to_f16(tl.load(p_k))
        if SC_AHEAD:
            b_sc = b_sc_next
            m_pg = m_pg_next
            if PG_AHEAD:
                b_sc_next, m_pg_next = _indexer_paged_page_scales(kv_ptr, i_pg_next, t0 + BLOCK_N, hi,
                                                                  num_pages, stride_page, D, PAGE,
                                                                  SCALE_ALIGNED)
                i_pg_next = tl.load(p_bt + tl.minimum(t0 // PAGE + 2, max_blocks - 1))
            else:
                b_sc_next, m_pg_next = _indexer_paged_scales(kv_ptr, p_bt, t0 + BLOCK_N, hi, num_pages,
                                                             max_blocks, stride_page, D, PAGE, BLOCK_N,
                                                             SCALE_ALIGNED)
        else:
            b_sc, m_pg = _indexer_paged_scales(kv_ptr, p_bt, t0, hi, num_pages, max_blocks, stride_page,
                                               D, PAGE, BLOCK_N, SCALE_ALIGNED)
        if ROW_LOOP:
            _indexer_paged_row(b_k, b_q0, b_w0, b_q0b, b_w0b, b_sc, m_pg, o_t, vis0, p_row0, j0,
                               NEXT_N, c1, HEAD_SLICES)
            if NP >= 2:
                _indexer_paged_row(b_k, b_q1, b_w1, b_q1b, b_w1b, b_sc, m_pg, o_t, vis1, p_row1, j0 + 1,
                                   NEXT_N, c1, HEAD_SLICES)
            if NP >= 4:
                _indexer_paged_row(b_k, b_q2, b_w2, b_q2b, b_w2b, b_sc, m_pg, o_t, vis2, p_row2, j0 + 2,
                                   NEXT_N, c1, HEAD_SLICES)
                _indexer_paged_row(b_k, b_q3, b_w3, b_q3b, b_w3b, b_sc, m_pg, o_t, vis3, p_row3, j0 + 3,
                                   NEXT_N, c1, HEAD_SLICES)
        else:
            b_s = tl.dot(b_k, tl.trans(b_q))  # [BLOCK_N, NP*HP]
            b_s = tl.maximum(b_s, 0.0) * b_w[None, :]
            b_l = tl.sum(tl.reshape(b_s, (BLOCK_N, NP, HP)), axis=2) * b_sc[:, None]  # [BLOCK_N, NP]
            m_hide = (o_t[:, None] >= b_vis[None, :]) | (~m_pg)[:, None]
            b_l = tl.where(m_hide, float("-inf"), b_l)
            tl.store(p_out + o_t[:, None], b_l, mask=m_j[None, :] & (o_t < c1)[:, None])

    # keys of this chunk that no row of the request sees
    b_inf = tl.full([BLOCK_N, NP], float("-inf"), tl.float32)
    t_fill = c0 + tl.cdiv(tl.maximum(hi - c0, 0), BLOCK_N) * BLOCK_N
    for t0 in range(t_fill, c1, BLOCK_N):
        o_t = t0 + tl.arange(0, BLOCK_N)
        tl.store(p_out + o_t[:, None], b_inf, mask=m_j[None, :] & (o_t < c1)[:, None])


@triton.jit
def _indexer_paged_schedule_kernel(
    ctx_ptr,
    out_ptr,
    B,
    ctx_stride,
    ctx_offset,
    num_sms,
    SPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_SM: tl.constexpr,
):
    # segments of request b: cdiv(ctx[b * ctx_stride + ctx_offset], SPLIT); worker w starts at
    # segment w * (total // num_sms) + min(w, total % num_sms) of the concatenation.
    o_b = tl.arange(0, BLOCK_B)
    total = 0
    for b0 in range(0, B, BLOCK_B):
        m_b = b0 + o_b < B
        b_len = tl.load(ctx_ptr + (b0 + o_b).to(tl.int64) * ctx_stride + ctx_offset, mask=m_b, other=0)
        total += tl.sum(tl.cdiv(tl.maximum(b_len, 0), SPLIT), axis=0)
    per = total // num_sms
    rem = total % num_sms
    for s0 in range(0, num_sms + 1, BLOCK_SM):
        o_s = s0 + tl.arange(0, BLOCK_SM)
        m_s = o_s <= num_sms
        b_start = o_s * per + tl.minimum(o_s, rem)  # [BLOCK_SM]
        b_req = tl.zeros([BLOCK_SM], dtype=tl.int32)
        b_before = tl.zeros([BLOCK_SM], dtype=tl.int32)
        carry = 0
        for b0 in range(0, B, BLOCK_B):
            m_b = b0 + o_b < B
            b_len = tl.load(ctx_ptr + (b0 + o_b).to(tl.int64) * ctx_stride + ctx_offset, mask=m_b, other=0)
            b_seg = tl.where(m_b, tl.cdiv(tl.maximum(b_len, 0), SPLIT), 0)
            b_pre = tl.cumsum(b_seg, axis=0) + carry  # [BLOCK_B] inclusive prefix
            m_le = (b_pre[None, :] <= b_start[:, None]) & m_b[None, :]  # [BLOCK_SM, BLOCK_B]
            b_req += tl.sum(m_le.to(tl.int32), axis=1)
            b_before += tl.sum(tl.where(m_le, b_seg[None, :], 0), axis=1)
            carry += tl.sum(b_seg, axis=0)
        tl.store(out_ptr + o_s * 2, b_req, mask=m_s)
        tl.store(out_ptr + o_s * 2 + 1, b_start - b_before, mask=m_s)
