"""Triton kernels of the lightning indexer over an MXFP4 key cache (DeepSeek-V4's 68-byte rows).

    logits[i, n] = sum_h relu(q[i, h] . k[n]) * w[i, h]

``k[n]`` is the dequantised MXFP4 row (e2m1 value times the UE8M0 scale of its 32-value block);
``q`` is either e4m3 (its scale folded into ``w`` by the caller) or MXFP4 with its own block scales.

Layouts (row-major, ``D = 128``):

- ragged: ``q [S, H, D]`` e4m3 bytes or ``[S, H, D/2]`` packed e2m1 with ``q_scale [S, H, D/32]`` u8;
  ``k [N, D/2]`` u8, ``k_scale [N, D/32]`` u8; ``w [S, H]`` f32; ``ks / ke [S]`` i32; out ``[S, N]``
  (or ``[S, max_seqlen_k]`` compressed) f32.
- paged: ``q [B, next_n, H, ...]``, ``w [B * next_n, H]``; cache ``u8 [P, PAGE, 1, D/2 + D/32]`` where page
  ``p`` starts at byte ``p * stride_page`` and holds ``PAGE * D/2`` packed bytes (token-major) followed by
  ``PAGE * D/32`` scale bytes; ``block_table [B, M]`` i32; out ``[B * next_n, max_ctx]`` f32.

Every operand is decoded in software, so one kernel compiles for sm_80 .. sm_121: an e2m1 code
``s e1 e0 m`` placed at bits 15 and 11..9 of an fp16 is its value times ``2**-14`` exactly (subnormal
included), an e4m3 byte at bits 15 and 13..7 its value times ``2**-8``; the UE8M0 byte ``b`` becomes the
fp32 ``2**(b - 127)`` from its bits. Each 32-value block is one fp16 MMA (``K_blk @ Q_blk^T``; the
products of these short mantissas are exact, the sums fp32) whose result is scaled by the key's and
the head's block factors in fp32, so block scales anywhere in ``2**-127 .. 2**127`` never pass through
fp16. Heads are padded to ``HP = max(16, next_pow2(H))`` with zero weights.

One program computes ``tiles_for(HP) * BLOCK_N`` output columns of one query row, ``BLOCK_N`` at a time,
with the row's query blocks decoded once; the paged kernel reads a key tile once per query row (``next_n`` times
per request). The kernels favour portability over speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEAD_DIM = 128
BLOCK_N = 64
# Key tiles per program up to 32 padded heads: a program decodes its query row's blocks and loads its weights
# once and reuses them over TILES tiles of BLOCK_N keys. Ahead of time on sm_120 that halves the instructions per
# MMA (35 against 61-97 with one tile per program, which decoded the query again for every 64 keys). From 64
# heads the decoded query held across the loop spills (8-212 B per thread), so those programs keep one tile.
TILES = 8


def tiles_for(hp: int) -> int:
    """Key tiles per program for ``hp`` padded heads."""
    return TILES if hp <= 32 else 1


def num_warps_for(hp: int) -> int:
    """Warps per program: 8 from 64 padded heads (a ``[64, 128]`` fp32 accumulator per block MMA at 4
    warps exhausts the registers, and sm_100's compiler rejects the paged kernel with MXFP4 queries)."""
    return 8 if hp >= 64 else 4


@triton.jit
def _ue8m0_to_f32(b):
    """UE8M0 bytes (as int32) -> fp32 ``2**(b - 127)``; byte 0 is ``2**-127`` (a subnormal)."""
    return tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_to_f16(code):
    """e2m1 codes (int32, 0..15) -> fp16 values times ``2**-14``, exactly, from the bit pattern."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp4_block(p_bytes, ok):
    """One 32-value block of MXFP4 rows: ``p_bytes`` ``[R, 16]`` pointers -> fp16 ``[R, 32]`` (value
    times ``2**-14``, even elements from the low nibble); rows where ``ok`` is false read as zero."""
    b = tl.load(p_bytes, mask=ok, other=0).to(tl.int32)
    vals = tl.join(_e2m1_to_f16(b & 15), _e2m1_to_f16(b >> 4))  # [R, 16, 2]: (even, odd)
    return tl.reshape(vals, (b.shape[0], 32))


@triton.jit
def _query_block(q_ptr, qs_ptr, q_row, H, blk: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                 Q_FP4: tl.constexpr):
    """Block ``blk`` (32 values) of one query row's heads: fp16 ``[HP, 32]`` and the fp32 factor ``[HP]``
    that restores its values (block scale and decoding shift); padded heads are zero."""
    offs_h = tl.arange(0, HP)
    h_ok = offs_h < H
    head = q_row.to(tl.int64) * H + offs_h
    if Q_FP4:
        q = _fp4_block(q_ptr + head[:, None] * (D // 2) + blk * 16 + tl.arange(0, 16)[None, :], h_ok[:, None])
        sc = tl.load(qs_ptr + head * (D // 32) + blk, mask=h_ok, other=127).to(tl.int32)
        factor = _ue8m0_to_f32(sc) * 16384.0
    else:
        x = tl.load(q_ptr + head[:, None] * D + blk * 32 + tl.arange(0, 32)[None, :], mask=h_ok[:, None],
                    other=0).to(tl.int32)
        # e4m3 bits at fp16 bits 15 and 13..7: the value times 2**-8, subnormals included.
        q = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        factor = tl.full((HP,), 256.0, tl.float32)
    return q, factor


@triton.jit
def _query_row(q_ptr, qs_ptr, w_ptr, row, H, HP: tl.constexpr, D: tl.constexpr, Q_FP4: tl.constexpr):
    """The four decoded blocks of query row ``row``, their factors (:func:`_query_block`) and its weights
    ``[HP]`` (zero for padded heads)."""
    q0, f0 = _query_block(q_ptr, qs_ptr, row, H, 0, HP, D, Q_FP4)
    q1, f1 = _query_block(q_ptr, qs_ptr, row, H, 1, HP, D, Q_FP4)
    q2, f2 = _query_block(q_ptr, qs_ptr, row, H, 2, HP, D, Q_FP4)
    q3, f3 = _query_block(q_ptr, qs_ptr, row, H, 3, HP, D, Q_FP4)
    offs_h = tl.arange(0, HP)
    w = tl.load(w_ptr + row.to(tl.int64) * H + offs_h, mask=offs_h < H, other=0.0)
    return q0, q1, q2, q3, f0, f1, f2, f3, w


@triton.jit
def _key_block_scores(p_bytes, p_scale, ok, q, q_factor, blk: tl.constexpr):
    """Scores ``[BLOCK_N, HP]`` of key block ``blk`` against the query block ``q`` (fp16 ``[HP, 32]``):
    one fp16 MMA (exact products, fp32 sums) scaled by the key's and the head's block factors."""
    k = _fp4_block(p_bytes + blk * 16, ok[:, None])
    k_factor = _ue8m0_to_f32(tl.load(p_scale + blk, mask=ok, other=127).to(tl.int32)) * 16384.0
    return tl.dot(k, tl.trans(q)) * k_factor[:, None] * q_factor[None, :]


@triton.jit
def _tile_logits(p_bytes, p_scale, ok, q0, q1, q2, q3, f0, f1, f2, f3, w, BLOCK_N: tl.constexpr,
                 HP: tl.constexpr):
    """``sum_h relu(q[h] . k[n]) * w[h]`` over a key tile -> fp32 ``[BLOCK_N]``.

    ``p_bytes`` ``[BLOCK_N, 16]`` points at each key's first block of packed bytes and ``p_scale``
    ``[BLOCK_N]`` at its first scale byte; ``q0..q3`` / ``f0..f3`` are the query row's four decoded blocks
    and their factors (:func:`_query_block`), ``w`` its weights ``[HP]``.
    """
    s = tl.zeros((BLOCK_N, HP), tl.float32)
    s += _key_block_scores(p_bytes, p_scale, ok, q0, f0, 0)
    s += _key_block_scores(p_bytes, p_scale, ok, q1, f1, 1)
    s += _key_block_scores(p_bytes, p_scale, ok, q2, f2, 2)
    s += _key_block_scores(p_bytes, p_scale, ok, q3, f3, 3)
    return tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)


@triton.jit
def _fp4_ragged_logits_kernel(
    q_ptr, qs_ptr, k_ptr, ks_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    N, H, cols, stride_out,
    D: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, Q_FP4: tl.constexpr,
    COMPRESSED: tl.constexpr,
):
    row = tl.program_id(0)
    c_start = tl.program_id(1) * (TILES * BLOCK_N)
    c_stop = tl.minimum(c_start + TILES * BLOCK_N, cols)
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    HALF: tl.constexpr = D // 2
    NS: tl.constexpr = D // 32
    # the query row's blocks and weights, decoded once for the program's TILES key tiles
    q0, q1, q2, q3, f0, f1, f2, f3, w = _query_row(q_ptr, qs_ptr, w_ptr, row, H, HP, D, Q_FP4)
    for c0 in range(c_start, c_stop, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        if COMPRESSED:
            n = ks + c
        else:
            n = c
        ok = (n >= ks) & (n < ke) & (n < N) & (n >= 0)
        logit = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        if tl.sum(ok.to(tl.int32), axis=0) > 0:
            n64 = n.to(tl.int64)
            p_b = k_ptr + n64[:, None] * HALF + tl.arange(0, 16)[None, :]
            s = _tile_logits(p_b, ks_scale_ptr + n64 * NS, ok, q0, q1, q2, q3, f0, f1, f2, f3, w, BLOCK_N, HP)
            logit = tl.where(ok, s, logit)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + c, logit, mask=c < c_stop)


@triton.jit
def _fp4_paged_logits_kernel(
    q_ptr, qs_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    H, NEXT_N, max_ctx, num_pages, max_blocks, stride_bt, stride_page, stride_out,
    D: tl.constexpr, HP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    Q_FP4: tl.constexpr, CTX_2D: tl.constexpr,
):
    row = tl.program_id(0)  # b * next_n + j
    b = row // NEXT_N
    j = row % NEXT_N
    t_start = tl.program_id(1) * (TILES * BLOCK_N)
    t_stop = tl.minimum(t_start + TILES * BLOCK_N, max_ctx)
    if CTX_2D:
        vis = tl.load(ctx_ptr + row)
    else:
        vis = tl.load(ctx_ptr + b) - NEXT_N + j + 1
    HALF: tl.constexpr = D // 2
    NS: tl.constexpr = D // 32
    # the query row's blocks and weights, decoded once for the program's TILES key tiles
    q0, q1, q2, q3, f0, f1, f2, f3, w = _query_row(q_ptr, qs_ptr, w_ptr, row, H, HP, D, Q_FP4)
    for t0 in range(t_start, t_stop, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        slot = t // PAGE
        ok = (t < vis) & (t < max_ctx) & (slot < max_blocks)
        page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + slot, mask=ok, other=-1)
        ok = ok & (page >= 0) & (page < num_pages)
        logit = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        if tl.sum(ok.to(tl.int32), axis=0) > 0:
            base = page.to(tl.int64) * stride_page
            r = (t % PAGE).to(tl.int64)
            p_b = kv_ptr + (base + r * HALF)[:, None] + tl.arange(0, 16)[None, :]
            s = _tile_logits(p_b, kv_ptr + base + PAGE * HALF + r * NS, ok, q0, q1, q2, q3, f0, f1, f2, f3, w,
                             BLOCK_N, HP)
            logit = tl.where(ok, s, logit)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + t, logit, mask=t < t_stop)


def _padded_heads(H: int) -> int:
    return max(16, triton.next_power_of_2(H))


def fp8_fp4_mqa_logits_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Ragged MXFP4-key logits (see :func:`nsa_backend.fp8_fp4_mqa_logits`); masked entries are ``-inf``."""
    S, H = q.shape[0], q.shape[1]
    N = k.shape[0]
    cols = max_seqlen_k if max_seqlen_k > 0 else N
    out = torch.empty(S, cols, dtype=torch.float32, device=q.device)
    if S == 0 or cols == 0:
        return out
    q_fp4 = q_scale is not None
    qb = q.view(torch.uint8)
    hp = _padded_heads(H)
    grid = (S, triton.cdiv(cols, tiles_for(hp) * BLOCK_N))
    _fp4_ragged_logits_kernel[grid](
        qb, q_scale if q_fp4 else qb, k.view(torch.uint8), k_scale.view(torch.uint8), weights,
        cu_seq_len_k_start, cu_seq_len_k_end, out, N, H, cols, out.stride(0),
        D=HEAD_DIM, HP=hp, BLOCK_N=BLOCK_N, TILES=tiles_for(hp), Q_FP4=q_fp4, COMPRESSED=max_seqlen_k > 0,
        num_warps=num_warps_for(hp))
    return out


def fp8_fp4_paged_mqa_logits_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor | None,
    max_context_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    """Paged MXFP4-key logits (see :func:`nsa_backend.fp8_fp4_paged_mqa_logits`); hidden keys are ``-inf``.
    ``schedule_meta`` is not needed: the grid ``(B * next_n, cdiv(max_context_len, tiles * BLOCK_N))`` depends on
    shapes only (no host synchronisation, graph-capturable)."""
    B, next_n, H = q.shape[0], q.shape[1], q.shape[2]
    rows = B * next_n
    out = torch.empty(rows, max_context_len, dtype=torch.float32, device=q.device)
    if rows == 0 or max_context_len == 0:
        return out
    if block_table.shape[1] == 0 or kv_cache.shape[0] == 0:
        return out.fill_(float("-inf"))
    q_fp4 = q_scale is not None
    qb = q.view(torch.uint8)
    hp = _padded_heads(H)
    grid = (rows, triton.cdiv(max_context_len, tiles_for(hp) * BLOCK_N))
    _fp4_paged_logits_kernel[grid](
        qb, q_scale if q_fp4 else qb, kv_cache, weights, context_lens, block_table, out,
        H, next_n, max_context_len, kv_cache.shape[0], block_table.shape[1], block_table.stride(0),
        kv_cache.stride(0), out.stride(0),
        D=HEAD_DIM, HP=hp, PAGE=kv_cache.shape[1], BLOCK_N=BLOCK_N, TILES=tiles_for(hp), Q_FP4=q_fp4,
        CTX_2D=context_lens.dim() == 2, num_warps=num_warps_for(hp))
    return out


__all__ = ["fp8_fp4_mqa_logits_triton", "fp8_fp4_paged_mqa_logits_triton"]
