"""Portable Triton (``tl``) sparse MLA attention: the tile kernel shared by prefill and decode.

``_sparse_mla_fwd_kernel`` is the one attention kernel of the family; prefill
(:func:`nsa_backend.kernels.sparse_mla_prefill.flash_mla_sparse_fwd_triton`) and decode
(:func:`nsa_backend.kernels.sparse_mla_decode.sparse_mla_decode_triton`) launch
it. One program handles one query row (``q[row]``: ``h_q`` heads sharing one list of ``topk``
key indices), a block of ``BLOCK_H`` heads and one split of the key list:

- the row's indices are read ``BLOCK_N`` at a time; every index is turned into a key address
  (``slot // page_size`` pages of ``stride_page``, rows of ``stride_row``), invalid ones (``< 0``,
  ``>= n_slots``, past ``topk_length``) are masked and never dereferenced;
- the gathered keys ``K [BLOCK_N, 512 (+ 64 rope)]`` are loaded once and shared by the
  ``BLOCK_H`` heads: ``S = q_nope K_nope^T + q_rope K_rope^T`` (two MMAs), online softmax in base 2,
  ``acc += P V`` with ``V = K_nope`` (the first 512 dims);
- ``KV_FP8`` reads "fp8_ds_mla" tokens (512 e4m3 bytes, four fp32 group scales, 64 bf16 rope
  values) and dequantises them to bf16, exactly as the reference does (no dequantised copy in global
  memory). With ``SHARE_KEYS`` (fp8 cache only) each latent group is converted once per tile into
  shared memory that both of its MMAs read (more shared memory: 70 KiB instead of 44 for 32 heads and
  32 keys on sm_120); without it the compiler converts the group into each MMA's operand layout, twice
  per tile.
  ``REREAD_KEYS`` (fp8 cache) instead reads each group's bytes a second time after the softmax, from the
  cache, and converts them again for ``P V``: no converted copy is held in registers across the softmax (the
  32-head tile on sm_120: 43 KiB, 4 B of spill against 396).
  ``FP8_NATIVE`` selects Triton's e4m3 type (sm_89+); otherwise the bytes are decoded with integer
  operations (e4m3 bits shifted into fp16 bits, scaled by 2^8);
- ``IDX_AHEAD`` reads the indices of a tile one iteration ahead. With the index load in the same
  iteration the compiler keeps one key buffer and waits for every gather right before its MMAs;
  without it, the gather has no in-iteration dependency and is pipelined over ``num_stages``
  buffers (for keys feeding the MMAs directly);
- each latent group is converted right before its ``q . k`` MMA (one converted group live at a time);
  with ``SHARE_KEYS`` or ``REREAD_KEYS`` groups 1-3 are also read there, after the rope product.

Outputs: ``SPLIT=False`` writes the final bf16 ``out``, the natural-log ``lse`` (``+inf`` for a row
without a valid key) and, when ``HAS_MAX``, ``max_logits``; ``attn_sink`` is applied here.
``SPLIT=True`` writes a normalised fp32 partial output and its base-2 ``lse`` (``-inf`` when
empty) for the decode merge kernel.

Tensor layouts (strides in elements of each pointer):
    q       [R, h_q, d_qk] bf16 (row stride ``stride_q_row``, head stride ``stride_q_head``)
    idx     [R, topk] int32 (row stride ``stride_idx_row``)
    kv      bf16 rows of ``d_qk`` values, or uint8 rows of 656 bytes
    out     row r, split s, head h at ``(r // rows_per_batch) * stride_ob + (r % rows_per_batch) * stride_or
             + s * stride_os + h * stride_oh``; lse / max likewise with ``stride_l*``
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_backend import envs
from nsa_backend.kernels.sparse_mla_prefill.common import pow2_dequant_ptx

# The CPU interpreter (Triton 3.9) multiplies bf16 dot operands as raw integers: it gets fp32
# operands instead, which is the same product (bf16 x bf16 is exact in fp32).
_INTERPRET = tl.constexpr(envs.triton_interpret())
_POW2_DEQUANT_PTX = tl.constexpr(pow2_dequant_ptx("fma"))


@triton.jit
def _sparse_mla_bf16(x):
    """fp32 -> bf16, round to nearest even (the CPU interpreter truncates and flushes subnormals, so it rounds
    by hand and takes the high half of the bits)."""
    if _INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _sparse_mla_f32(x):
    """bf16 -> fp32 through the bits (the CPU interpreter's conversion flushes bf16 subnormals to zero)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _sparse_mla_mma(a, b):
    """``a @ b`` with bf16 operands and fp32 accumulation."""
    if _INTERPRET:
        return tl.dot(_sparse_mla_f32(a), _sparse_mla_f32(b))
    else:
        return tl.dot(a, b)


@triton.jit
def _sparse_mla_group(p_row, m_n, G: tl.constexpr):
    """Latent group ``G`` [BN, 128] of the key rows ``p_row`` as stored (zeros where ``m_n`` is off)."""
    o_c = tl.arange(0, 128)
    return tl.load(p_row[:, None] + (G * 128 + o_c[None, :]), mask=m_n[:, None], other=0)


@triton.jit
def _sparse_mla_group_again(p_row, m_n, G: tl.constexpr):
    """:func:`_sparse_mla_group` read a second time in a tile, for the ``P V`` product (``REREAD_KEYS``). The
    bytes were just read, so this read hits the cache; its eviction hint (the last use of the line) also keeps
    the compiler from merging it with the first read."""
    o_c = tl.arange(0, 128)
    return tl.load(p_row[:, None] + (G * 128 + o_c[None, :]), mask=m_n[:, None], other=0,
                   eviction_policy="evict_first")


@triton.jit
def _sparse_mla_gather(kv_ptr, b_idx, n_slots, page_size, stride_page, stride_row,
                       BLOCK_N: tl.constexpr, D_ROPE: tl.constexpr, KV_FP8: tl.constexpr):
    """Raw keys of the slots ``b_idx`` [BN], as stored (no conversion), except latent groups 1-3.

    Returns ``(m_n, p_row, r0, s0, s1, s2, s3, rr)``: the valid-key mask [BN], the key row pointers
    [BN] (for :func:`_sparse_mla_group`), latent group 0 [BN, 128] (e4m3 bytes or bf16), the four
    groups' fp32 scales [BN] (FP8 cache; ones otherwise) and the rope part [BN, D_ROPE] bf16.
    Invalid slots read as zeros and are never dereferenced.
    """
    m_n = (b_idx >= 0) & (b_idx < n_slots)
    b_slot = tl.where(m_n, b_idx, 0).to(tl.int64)
    p_row = kv_ptr + (b_slot // page_size) * stride_page + (b_slot % page_size) * stride_row
    o_r = tl.arange(0, D_ROPE if D_ROPE > 0 else 16)
    r0 = _sparse_mla_group(p_row, m_n, 0)
    if KV_FP8:
        p_sc = (p_row + 512).to(tl.pointer_type(tl.float32))
        s0 = tl.load(p_sc, mask=m_n, other=0.0)
        s1 = tl.load(p_sc + 1, mask=m_n, other=0.0)
        s2 = tl.load(p_sc + 2, mask=m_n, other=0.0)
        s3 = tl.load(p_sc + 3, mask=m_n, other=0.0)
        p_rope = (p_row + 528).to(tl.pointer_type(tl.bfloat16))
    else:
        s0 = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        p_rope = p_row + 512
    if D_ROPE > 0:
        rr = tl.load(p_rope[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0)
    else:
        rr = tl.zeros([BLOCK_N, 16], dtype=tl.bfloat16)
    return m_n, p_row, r0, s0, s1, s2, s3, rr


@triton.jit
def _sparse_mla_shared(x):
    """``x`` unchanged, through an instruction the compiler may not duplicate, so that the dequantised keys are
    computed once and stored to shared memory for both of their MMAs. Without it the conversion is moved into each
    MMA's operand layout (done twice per tile) and the copy for ``P V``, made before the first MMA, is held in
    registers across the softmax: the 32-head fp8 tile spills 396 B per thread on sm_120 that way, none with it
    (but it then needs 70 KiB of shared memory instead of 44)."""
    if _INTERPRET:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _sparse_mla_pow2_dequant(b_raw, b_sc):
    """``bf16(e4m3 * scale)`` of the e4m3 bytes ``b_raw`` [BN, 128] for power-of-two scales ``b_sc`` [BN] below
    ``2^8``, the reference's numbers in 2 instructions per element (3 through the fp8 unit, more on sm_86): integer
    bits of ``e4m3 * 2^-120`` and one ``bf16x2`` product with ``bf16(scale * 2^120)`` (``pow2_dequant_ptx``; ``fma``
    with ``-0.0``, since ``mul.bf16x2`` needs sm_90)."""
    b_s16 = tl.broadcast_to((b_sc * 1.329227995784916e36).to(tl.bfloat16)[:, None], b_raw.shape)  # scale * 2^120
    return tl.inline_asm_elementwise(_POW2_DEQUANT_PTX, "=r,=r,r,r,r", [b_raw, b_s16], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)


@triton.jit
def _sparse_mla_dequant(b_raw, b_sc, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, SHARE_KEYS: tl.constexpr,
                        POW2_SCALES: tl.constexpr):
    """One raw latent group [BN, 128] -> bf16 keys: unchanged for the bf16 cache, ``bf16(e4m3 * scale)``
    for the FP8 cache, exactly as the reference dequantises (``SHARE_KEYS``: once, for both MMAs;
    ``POW2_SCALES``: power-of-two scales, :func:`_sparse_mla_pow2_dequant`)."""
    if KV_FP8:
        if POW2_SCALES and not _INTERPRET:
            b_k = _sparse_mla_pow2_dequant(b_raw, b_sc)
        else:
            if FP8_NATIVE:
                b_kf = b_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                # e4m3 bits -> fp16 bits (value * 2^-8), exact for every e4m3 value
                b_u = b_raw.to(tl.uint16)
                b_kf = (((b_u & 0x80) << 8) | ((b_u & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
                b_sc = b_sc * 256.0
            b_k = _sparse_mla_bf16(b_kf * b_sc[:, None])
        if SHARE_KEYS:
            b_k = _sparse_mla_shared(b_k)
        return b_k
    else:
        return b_raw


@triton.jit
def _sparse_mla_values(b_k, p_row, m_n, b_sc, G: tl.constexpr, KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
                       REREAD_KEYS: tl.constexpr, POW2_SCALES: tl.constexpr):
    """Latent group ``G`` for ``P V``: ``b_k`` as converted for ``q K^T``, or with ``REREAD_KEYS`` the group's bytes
    read (:func:`_sparse_mla_group_again`) and converted again, so that no converted copy is held across the
    softmax."""
    if REREAD_KEYS:
        return _sparse_mla_dequant(_sparse_mla_group_again(p_row, m_n, G), b_sc, KV_FP8, FP8_NATIVE, False,
                                   POW2_SCALES)
    else:
        return b_k


@triton.jit
def _sparse_mla_store_group(out_ptr, o_oh, m_h, b_acc, b_inv, G: tl.constexpr, TO_BF16: tl.constexpr):
    """Write the normalised accumulator of latent group ``G`` ([BH, 128])."""
    o_c = tl.arange(0, 128)
    b_o = b_acc * b_inv[:, None]
    if TO_BF16:
        b_o = _sparse_mla_bf16(b_o)
    tl.store(out_ptr + o_oh[:, None] + (G * 128 + o_c[None, :]), b_o, mask=m_h[:, None])


@triton.heuristics({
    "HAS_SINK": lambda args: args["sink_ptr"] is not None,
    "HAS_TOPK_LEN": lambda args: args["topk_len_ptr"] is not None,
    "HAS_MAX": lambda args: args["max_ptr"] is not None,
})
@triton.jit(do_not_specialize=["h_q", "topk", "n_slots", "page_size", "keys_per_split", "rows_per_batch",
                               "stride_idx_row", "stride_lb", "stride_lr", "stride_ls", "stride_lh"])
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
    out_ptr, lse_ptr, max_ptr,
    qk_scale,
    h_q, topk, n_slots, page_size, keys_per_split, rows_per_batch,
    stride_q_row, stride_q_head, stride_idx_row,
    stride_page, stride_row,
    stride_ob, stride_or, stride_os, stride_oh,
    stride_lb, stride_lr, stride_ls, stride_lh,
    D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, SPLIT: tl.constexpr,
    IDX_AHEAD: tl.constexpr, SHARE_KEYS: tl.constexpr, REREAD_KEYS: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, HAS_MAX: tl.constexpr,
    POW2_SCALES: tl.constexpr = False,
):
    # The 512 latent dims are handled as four groups of 128 (the fp8_ds_mla scale groups): four
    # [BH, 128] accumulators and [BN, 128] key tiles keep the register footprint of a program small.
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    i_b = i_r // rows_per_batch
    i_q = i_r % rows_per_batch

    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_c = tl.arange(0, 128)
    o_r = tl.arange(0, D_ROPE if D_ROPE > 0 else 16)

    p_q = q_ptr + i_r * stride_q_row + o_h.to(tl.int64)[:, None] * stride_q_head
    # [BH, 128] x 4
    b_q0 = tl.load(p_q + o_c[None, :], mask=m_h[:, None], other=0.0)
    b_q1 = tl.load(p_q + 128 + o_c[None, :], mask=m_h[:, None], other=0.0)
    b_q2 = tl.load(p_q + 256 + o_c[None, :], mask=m_h[:, None], other=0.0)
    b_q3 = tl.load(p_q + 384 + o_c[None, :], mask=m_h[:, None], other=0.0)
    if D_ROPE > 0:
        # [BH, 64]
        b_qr = tl.load(p_q + 512 + o_r[None, :], mask=m_h[:, None], other=0.0)

    n_end = topk
    if HAS_TOPK_LEN:
        n_end = tl.minimum(tl.maximum(tl.load(topk_len_ptr + i_b), 0), topk)
    n_start = i_s * keys_per_split
    n_stop = tl.minimum(n_start + keys_per_split, n_end)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    p_idx = idx_ptr + i_r * stride_idx_row
    if IDX_AHEAD:
        # The indices of a tile are read one iteration ahead (a loop-carried register tile): the key
        # gather then depends on no load of its own iteration, and the compiler pipelines it over
        # num_stages shared-memory buffers (with an in-iteration index load it keeps one buffer).
        o_nx = n_start + tl.arange(0, BLOCK_N)
        b_idx_nx = tl.load(p_idx + o_nx, mask=o_nx < n_stop, other=-1)
    for n0 in range(n_start, n_stop, BLOCK_N):
        if IDX_AHEAD:
            b_idx = b_idx_nx
            o_nx = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            b_idx_nx = tl.load(p_idx + o_nx, mask=o_nx < n_stop, other=-1)
        else:
            o_n = n0 + tl.arange(0, BLOCK_N)
            b_idx = tl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
        (m_n, p_row, r0, s0, s1, s2, s3, b_kr) = _sparse_mla_gather(
            kv_ptr, b_idx, n_slots, page_size, stride_page, stride_row, BLOCK_N, D_ROPE, KV_FP8)
        # [BN, 128] keys, [BH, BN] scores
        if SHARE_KEYS or REREAD_KEYS:
            # the rope product first, then each latent group read and converted right before its MMA:
            # one raw and one converted group at a time are live beside the accumulators (with
            # REREAD_KEYS the group is read again for P V below)
            if D_ROPE > 0:
                b_s = _sparse_mla_mma(b_qr, tl.trans(b_kr))
            else:
                b_s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
            b_k0 = _sparse_mla_dequant(r0, s0, KV_FP8, FP8_NATIVE, SHARE_KEYS, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q0, tl.trans(b_k0))
            b_k1 = _sparse_mla_dequant(_sparse_mla_group(p_row, m_n, 1), s1, KV_FP8, FP8_NATIVE,
                                        SHARE_KEYS, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q1, tl.trans(b_k1))
            b_k2 = _sparse_mla_dequant(_sparse_mla_group(p_row, m_n, 2), s2, KV_FP8, FP8_NATIVE,
                                        SHARE_KEYS, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q2, tl.trans(b_k2))
            b_k3 = _sparse_mla_dequant(_sparse_mla_group(p_row, m_n, 3), s3, KV_FP8, FP8_NATIVE,
                                        SHARE_KEYS, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q3, tl.trans(b_k3))
        else:
            # The whole key is loaded first (loading groups 1-3 later was 9-38% slower, docs/sparse_mla.md)
            # and each group converted right before its MMA (all four converted first, ptxas spilled
            # 336 B per thread in the 32-head fp8 decode on sm_120; 204 B this way).
            r1 = _sparse_mla_group(p_row, m_n, 1)
            r2 = _sparse_mla_group(p_row, m_n, 2)
            r3 = _sparse_mla_group(p_row, m_n, 3)
            b_k0 = _sparse_mla_dequant(r0, s0, KV_FP8, FP8_NATIVE, False, POW2_SCALES)
            b_s = _sparse_mla_mma(b_q0, tl.trans(b_k0))
            b_k1 = _sparse_mla_dequant(r1, s1, KV_FP8, FP8_NATIVE, False, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q1, tl.trans(b_k1))
            b_k2 = _sparse_mla_dequant(r2, s2, KV_FP8, FP8_NATIVE, False, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q2, tl.trans(b_k2))
            b_k3 = _sparse_mla_dequant(r3, s3, KV_FP8, FP8_NATIVE, False, POW2_SCALES)
            b_s += _sparse_mla_mma(b_q3, tl.trans(b_k3))
            if D_ROPE > 0:
                # [BN, 64]
                b_s += _sparse_mla_mma(b_qr, tl.trans(b_kr))
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_m_use[:, None])
        b_alpha = tl.math.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_p16 = _sparse_mla_bf16(b_p)
        b_acc0 = b_acc0 * b_alpha[:, None] + _sparse_mla_mma(
            b_p16, _sparse_mla_values(b_k0, p_row, m_n, s0, 0, KV_FP8, FP8_NATIVE, REREAD_KEYS,
                                      POW2_SCALES))
        b_acc1 = b_acc1 * b_alpha[:, None] + _sparse_mla_mma(
            b_p16, _sparse_mla_values(b_k1, p_row, m_n, s1, 1, KV_FP8, FP8_NATIVE, REREAD_KEYS,
                                      POW2_SCALES))
        b_acc2 = b_acc2 * b_alpha[:, None] + _sparse_mla_mma(
            b_p16, _sparse_mla_values(b_k2, p_row, m_n, s2, 2, KV_FP8, FP8_NATIVE, REREAD_KEYS,
                                      POW2_SCALES))
        b_acc3 = b_acc3 * b_alpha[:, None] + _sparse_mla_mma(
            b_p16, _sparse_mla_values(b_k3, p_row, m_n, s3, 3, KV_FP8, FP8_NATIVE, REREAD_KEYS,
                                      POW2_SCALES))
        b_m = b_m_new

    m_empty = b_l == 0.0
    b_inv = 1.0 / tl.where(m_empty, 1.0, b_l)
    # base-2 lse
    b_lse2 = tl.where(m_empty, float("-inf"), b_m + tl.math.log2(tl.where(m_empty, 1.0, b_l)))
    o_oh = (i_b * stride_ob + i_q * stride_or + i_s * stride_os + o_h.to(tl.int64) * stride_oh)
    o_lh = (i_b * stride_lb + i_q * stride_lr + i_s * stride_ls + o_h.to(tl.int64) * stride_lh)
    if SPLIT:
        tl.store(lse_ptr + o_lh, b_lse2, mask=m_h)
    else:
        b_lse = tl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
        if HAS_SINK:
            b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=0.0)
            # exp(lse) / (exp(lse) + exp(sink)); 0 for empty rows (lse = +inf, out already 0)
            b_inv = b_inv / (1.0 + tl.exp(b_sink - tl.where(m_empty, 0.0, b_lse)))
        tl.store(lse_ptr + o_lh, b_lse, mask=m_h)
        if HAS_MAX:
            tl.store(max_ptr + o_lh, b_m * 0.6931471805599453, mask=m_h)
    _sparse_mla_store_group(out_ptr, o_oh, m_h, b_acc0, b_inv, 0, not SPLIT)
    _sparse_mla_store_group(out_ptr, o_oh, m_h, b_acc1, b_inv, 1, not SPLIT)
    _sparse_mla_store_group(out_ptr, o_oh, m_h, b_acc2, b_inv, 2, not SPLIT)
    _sparse_mla_store_group(out_ptr, o_oh, m_h, b_acc3, b_inv, 3, not SPLIT)
