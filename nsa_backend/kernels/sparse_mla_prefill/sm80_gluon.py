"""Gluon sparse MLA over bf16 keys for the mma.sync archs (sm_80 / 86 / 89 / 120 / 121), ``q`` in registers.

:func:`flash_mla_sparse_fwd_mma_v2` computes :func:`nsa_backend.flash_mla_sparse_fwd` for bf16 ``q`` / ``kv``
with ``d_qk`` 576 (512 latent + 64 rope) and ``d_v`` 512 within 99 KiB of shared memory; the decode over a bf16
paged cache (``nsa_backend/kernels/sparse_mla_decode/sm80_gluon.py``) launches the same kernel over the cache's
pages, with the top-k list split over programs and the splits merged, as the ``tl`` tile serves both. A program
takes one query row, ``BLOCK_H = 32`` heads and one split of the row's top-k list (grid ``(rows * head blocks,
splits)``: the head blocks of a row are neighbours in the launch order and gather the same keys) and walks it
``BLOCK_N = 32`` keys at a time with eight warps:

- the latent part of ``q`` (``[32, 512]``) is loaded once into the registers of the MMA's ``A`` operand and
  stays there; its rope part stays in shared memory;
- the bf16 key rows of a tile (row ``slot % PAGE`` of page ``slot // PAGE``; the prefill's rows are pages of
  one) come by ``cp.async`` into a ring of ``STAGES`` buffers (four ``[32, 128]`` latent groups and the
  ``[32, 64]`` rope part each, every one its own allocation: :func:`mma_v2_key_ring`), ``STAGES - 1`` tiles ahead;
  invalid slots (``< 0``, ``>= n_slots``, past ``topk_length``) are zero-filled and their scores ``-inf``. Both
  products read the ring buffer itself: there is no conversion, so a tile takes two barriers. The loop takes
  ``STAGES`` tiles an iteration, so that each tile's buffers are known when compiling and Triton puts no barrier of
  its own between the copies into one stage and the products over another;
- :func:`mma_v2_attend_tile` (shared with the fp8 decode of ``sparse_mla_decode/sm89_gluon.py``) computes the
  scores, the online softmax and ``O += P V`` of one tile: the warps form a 2 x 4 grid over
  ``S [32 heads, 32 keys]``, four score accumulators (one per latent group), the scores pass through shared
  memory once and each warp reads its head group's ``[16, 32]`` back in the layout of ``P``'s operand, as two
  16-key halves: ``P V`` takes every latent group's first half, then every group's second, so that no two MMAs
  into one accumulator are issued back to back.

Outputs follow the ``tl`` tile (``_sparse_mla_fwd_kernel``): with one split natural-log ``lse`` (``+inf`` and
``out = 0`` for a row without a valid key), ``max_logits`` (``-inf`` then; the prefill), ``attn_sink`` scaling by
``1 / (1 + exp(sink - lse))``; with several splits the normalised fp32 partials and base-2 lse that the decode's
merge combines. ``topk_length`` truncates each batch's lists (``[s_q]`` for the prefill, whose rows are batches
of one).

Shared memory with two stages: keys 64 KiB + rope 8 KiB + ``q`` rope 4 KiB + scores 5 KiB (padded rows) = 81 KiB.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable
from nsa_backend.kernels._launch import cached_launcher
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E, gluon_rows_supported, prefill_outputs, prefill_rows

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None

# Architectures the kernel is written for (mma.sync, bf16 keys, 99 KiB of shared memory per block or more).
MMA_V2_PREFILL_ARCHS: tuple[int, ...] = (80, 86, 89, 120, 121)
BLOCK_H = 32
BLOCK_N = 32
NUM_WARPS = 8
STAGES = 2
# With ``LAZY_RESCALE`` (:func:`mma_v2_attend_tile`), a head's reference max for the exponentials moves only when its
# scores exceed it by more than this (base 2): ``P`` stays below 256 and ``O``'s rescale is skipped in most tiles.
RESCALE_THRESHOLD = triton.language.constexpr(8.0)
# ``O``'s values a thread holds per ``[BLOCK_H, 128]`` accumulator (eight warps): one inline assembly block takes them.
_RESCALE_PACK = triton.language.constexpr(BLOCK_H * 128 // (NUM_WARPS * 32))


def _rescale_ptx(n: int) -> tuple[str, str]:
    """Inline PTX and constraints of ``_mma_v2_rescale`` over ``n`` values: a uniform branch around the ``n``
    products, the outputs tied to ``O``'s inputs so that the skipped branch leaves them as they are."""
    products = " ".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n))
    ptx = f"{{ .reg .pred p; setp.eq.b32 p, ${3 * n}, 0; @p bra.uni SKIP; {products} SKIP: }}"
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n + ["r"] * n)
    return ptx, constraints


_RESCALE_PTX, _RESCALE_CONSTRAINTS = (triton.language.constexpr(x) for x in _rescale_ptx(_RESCALE_PACK.value))
# For each thread's pair of values: 1 in every lane of the warp if any lane's pair holds a non-zero, else 0.
_WARP_ANY_PTX = triton.language.constexpr(
    "{ .reg .pred p; or.b32 $0, $2, $3; setp.ne.b32 p, $0, 0; vote.sync.any.pred p, p, 0xffffffff; "
    "selp.b32 $0, 1, 0, p; mov.b32 $1, $0; }")


if gluon is not None:

    @gluon.jit
    def _mma_v2_q_part(p_q, o_c, m_h, q_buf, OP_A: gl.constexpr):
        """One ``[BLOCK_H, cols]`` slice of ``q`` into the ``A`` operand's registers (through ``q_buf``)."""
        q_buf.store(gl.load(p_q + o_c, mask=m_h, other=0.0))
        cta_barrier()
        b_q = q_buf.load(OP_A)
        cta_barrier()
        return b_q

    @gluon.jit
    def mma_v2_load_q(p_q_row, stride_q_head, i_h, h_q, q_buf, qr_smem, BLOCK_H: gl.constexpr,
                      NUM_WARPS: gl.constexpr, OP_A: gl.constexpr):
        """Heads ``i_h * BLOCK_H ..`` of the ``q`` row at ``p_q_row`` (``[h_q, 576]``, heads past ``h_q`` zero): the
        latent part into the registers of the ``A`` operand, four ``[BLOCK_H, 128]`` groups passed through
        ``q_buf`` (``[BLOCK_H, 128]`` bf16 shared memory free until then), and the rope part into ``qr_smem``."""
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q))
        m_hq = gl.expand_dims(o_h < h_q, 1)
        p_q = p_q_row + gl.expand_dims(o_h.to(gl.int64) * stride_q_head, 1)
        o_qc = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_Q)), 0)
        b_q0 = _mma_v2_q_part(p_q, o_qc, m_hq, q_buf, OP_A)
        b_q1 = _mma_v2_q_part(p_q + 128, o_qc, m_hq, q_buf, OP_A)
        b_q2 = _mma_v2_q_part(p_q + 256, o_qc, m_hq, q_buf, OP_A)
        b_q3 = _mma_v2_q_part(p_q + 384, o_qc, m_hq, q_buf, OP_A)
        o_qr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q)), 0)
        qr_smem.store(gl.load(p_q + 512 + o_qr, mask=m_hq, other=0.0))
        return b_q0, b_q1, b_q2, b_q3

    @triton.constexpr_function
    def mma_v2_tile_layout():
        """The tile's register layout: m16n8 mma.sync products on a 2 x 4 grid of its eight warps."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 4], instr_shape=[16, 8])

    @triton.constexpr_function
    def mma_v2_keys_layout():
        """Shared layout of the key rows (256 bytes, 128 for the rope part) and of ``q``'s: 16-byte vectors XORed by
        the row over the eight bank groups."""
        return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])

    @triton.constexpr_function
    def mma_v2_scores_layout(block_h, block_n):
        """Shared layout of the score exchange (:func:`mma_v2_scores_smem`): eight words of padding after each row."""
        return gl.PaddedSharedLayout.with_identity_for([[block_n, 8]], [block_h, block_n], [1, 0])

    @gluon.jit
    def mma_v2_scores_smem(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
        """The score exchange's ``[BLOCK_H, BLOCK_N]`` fp32 buffer (:func:`mma_v2_attend_tile`), eight words of padding
        after each row. The exchange stores and loads two words a thread, a half-warp spanning four rows: rows of 32
        words that all start in bank 0 would put those four rows in the same eight banks (four times the wavefronts);
        with the padding row ``r`` starts in bank ``8 r``, and the four rows take all 32 banks
        (``tests/ops/test_mma_v2_banks.py`` counts them)."""
        return gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_N], mma_v2_scores_layout(BLOCK_H, BLOCK_N))

    @gluon.jit
    def mma_v2_attend_tile(b_q0, b_q1, b_q2, b_q3, k0, k1, k2, k3, qr_smem, kr, s_smem, m_n, b_m, b_l,
                           b_acc0, b_acc1, b_acc2, b_acc3, b_zero, qk_scale, MMA: gl.constexpr,
                           LAZY_RESCALE: gl.constexpr = False, ROPE_CHAIN: gl.constexpr = False):
        """One key tile of the online softmax for ``[32, 576]`` heads of ``q`` on a ``2 x 4`` mma.sync grid.

        ``b_q0..3``: the latent part of ``q`` in the ``A`` operand's registers, 128 dims each; ``k0..3``: the
        tile's latent keys ``[BLOCK_N, 128]`` in shared memory (also ``V``); ``qr_smem`` / ``kr``: the rope parts
        of ``q`` and of the keys; ``s_smem``: the score exchange (:func:`mma_v2_scores_smem`); ``m_n``: the
        valid keys (``COL`` of ``MMA``); ``b_m`` / ``b_l``: running max (base 2) and sum in the row layout of the
        ``A`` operand; ``b_acc0..3``: ``O`` in ``MMA``. Returns the updated ``b_m, b_l, b_acc0..3``. ``P`` and
        ``P V`` are taken in two halves of the keys (``BLOCK_N / 2`` each, at least 16: the MMA's ``k``).

        ``LAZY_RESCALE``: ``b_m`` is the reference of the exponentials rather than the max. It moves to the tile's max
        only where that exceeds it by more than ``RESCALE_THRESHOLD``, and a warp whose sixteen heads all keep theirs
        skips ``O``'s rescale (a uniform branch). It ran the fp8 decode 1.01-1.06x faster under the proxy (arbitrary
        scales); in the bf16 kernel the rescale's products fill stalls, and the branches cost more than they save.

        ``ROPE_CHAIN``: the rope part's scores in an accumulator of their own rather than added to the first latent
        group's. Without it ptxas issues that group's and the rope's twelve MMAs as one dependent chain, an idle slot or
        two after each, before it interleaves the other groups; with it the four groups interleave from the start. The
        bf16 kernel gains 1-2 % under the proxy; the fp8 decode measured no faster.
        """
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        HALF: gl.constexpr = s_smem.shape[1] // 2
        # S: each warp its 16 heads x 8 keys, in four accumulators (one chain of 36 dependent MMAs would wait on
        # each MMA's latency), and the rope part's four MMAs in a fifth (ROPE_CHAIN) or after the first group's
        if ROPE_CHAIN:
            b_sr = mma_v2(qr_smem.load(OP_A), kr.permute((1, 0)).load(OP_B), b_zero)
        b_s0 = mma_v2(b_q0, k0.permute((1, 0)).load(OP_B), b_zero)
        b_s1 = mma_v2(b_q1, k1.permute((1, 0)).load(OP_B), b_zero)
        b_s2 = mma_v2(b_q2, k2.permute((1, 0)).load(OP_B), b_zero)
        b_s3 = mma_v2(b_q3, k3.permute((1, 0)).load(OP_B), b_zero)
        if ROPE_CHAIN:
            b_s = gl.where(gl.expand_dims(m_n, 0), ((b_s0 + b_s1) + (b_s2 + b_s3) + b_sr) * qk_scale, float("-inf"))
        else:
            b_s0 = mma_v2(qr_smem.load(OP_A), kr.permute((1, 0)).load(OP_B), b_s0)
            b_s = gl.where(gl.expand_dims(m_n, 0), ((b_s0 + b_s1) + (b_s2 + b_s3)) * qk_scale, float("-inf"))
        # every warp of a head group reads the group's scores [16, BLOCK_N] back in the A operand's layout (one
        # barrier); the max, P and the sums then stay inside the warp
        s_smem.store(b_s)
        cta_barrier()
        # in two halves of the keys: an accumulator's two MMAs are then 16 MMAs apart, not back to back (ptxas put two
        # idle instructions between such a pair), and the halves' max and sum still take one reduction each
        b_sa0 = s_smem.slice(0, HALF, dim=1).load(OP_A)
        b_sa1 = s_smem.slice(HALF, HALF, dim=1).load(OP_A)
        b_tmax = gl.max(gl.maximum(b_sa0, b_sa1), axis=1)
        if LAZY_RESCALE:
            # from -inf the reference moves at the head's first valid key
            b_move = b_tmax > b_m + RESCALE_THRESHOLD
            b_m_new = gl.where(b_move, b_tmax, b_m)
        else:
            b_m_new = gl.maximum(b_m, b_tmax)
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p0 = gl.exp2(b_sa0 - gl.expand_dims(b_m_use, 1))
        b_p1 = gl.exp2(b_sa1 - gl.expand_dims(b_m_use, 1))
        b_alpha = gl.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + gl.sum(b_p0 + b_p1, axis=1)
        b_pa0 = b_p0.to(gl.bfloat16)
        b_pa1 = b_p1.to(gl.bfloat16)
        b_alpha = gl.expand_dims(gl.convert_layout(b_alpha, ROW), 1)
        b_any = 1  # every warp rescales O
        if LAZY_RESCALE:
            # whether any head of the warp moved its reference: the same in every lane, so the rescale is a uniform
            # branch (b_alpha is 1 for a head that keeps its reference, 0 before its first valid key, where O is 0)
            b_any = gl.inline_asm_elementwise(_WARP_ANY_PTX, "=r,=r,r,r", [b_move.to(gl.int32)], dtype=gl.int32,
                                              is_pure=True, pack=2)
            b_any = gl.expand_dims(gl.convert_layout(b_any, ROW), 1)
        # O [BLOCK_H, 512] += P V, V = the latent keys: every group's first half, then every group's second
        b_acc0 = mma_v2(b_pa0, k0.slice(0, HALF, dim=0).load(OP_B),
                        _mma_v2_rescale(b_acc0, b_alpha, b_any, LAZY_RESCALE))
        b_acc1 = mma_v2(b_pa0, k1.slice(0, HALF, dim=0).load(OP_B),
                        _mma_v2_rescale(b_acc1, b_alpha, b_any, LAZY_RESCALE))
        b_acc2 = mma_v2(b_pa0, k2.slice(0, HALF, dim=0).load(OP_B),
                        _mma_v2_rescale(b_acc2, b_alpha, b_any, LAZY_RESCALE))
        b_acc3 = mma_v2(b_pa0, k3.slice(0, HALF, dim=0).load(OP_B),
                        _mma_v2_rescale(b_acc3, b_alpha, b_any, LAZY_RESCALE))
        b_acc0 = mma_v2(b_pa1, k0.slice(HALF, HALF, dim=0).load(OP_B), b_acc0)
        b_acc1 = mma_v2(b_pa1, k1.slice(HALF, HALF, dim=0).load(OP_B), b_acc1)
        b_acc2 = mma_v2(b_pa1, k2.slice(HALF, HALF, dim=0).load(OP_B), b_acc2)
        b_acc3 = mma_v2(b_pa1, k3.slice(HALF, HALF, dim=0).load(OP_B), b_acc3)
        return b_m_new, b_l, b_acc0, b_acc1, b_acc2, b_acc3

    @gluon.jit
    def _mma_v2_rescale(b_acc, b_alpha, b_any, LAZY_RESCALE: gl.constexpr):
        """``b_acc * b_alpha`` over one ``[BLOCK_H, 128]`` accumulator of ``O`` (``b_alpha`` broadcast over the
        columns). ``LAZY_RESCALE``: skipped where the warp's ``b_any`` is 0 (the same in every lane of a warp)."""
        if LAZY_RESCALE:
            b_acc = gl.inline_asm_elementwise(_RESCALE_PTX, _RESCALE_CONSTRAINTS, [b_acc, b_alpha, b_any],
                                              dtype=gl.float32, is_pure=True, pack=_RESCALE_PACK)
        else:
            b_acc = b_acc * b_alpha
        return b_acc

    @gluon.jit
    def mma_v2_latent_smem(BLOCK_N: gl.constexpr):
        """One tile's bf16 latent keys: the four groups ``[BLOCK_N, 128]``, each its own allocation. Triton inserts a
        CTA barrier between two accesses to one allocation when one of them writes and no barrier separates them, and
        does not tell apart the parts of one allocation (Triton 3.6 / 3.8 not even at indices known when compiling):
        with one allocation a group, the four groups' copies or stores need none between them."""
        K_SL: gl.constexpr = mma_v2_keys_layout()
        return (gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], K_SL),
                gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], K_SL),
                gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], K_SL),
                gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], K_SL))

    @gluon.jit
    def mma_v2_key_ring(STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """The key ring: per stage the four latent groups (:func:`mma_v2_latent_smem`) and the rope part
        ``[BLOCK_N, 64]``, each its own allocation, so that the copies into the next stage and the products over this
        one need no barrier between them."""
        K_SL: gl.constexpr = mma_v2_keys_layout()
        ring = ()
        for _ in gl.static_range(STAGES):
            latent = mma_v2_latent_smem(BLOCK_N)
            rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 64], K_SL)
            ring = ring + (latent + (rope,),)  # noqa: RUF005 (Gluon's frontend takes no starred expressions)
        return ring

    @gluon.jit
    def _mma_v2_slots(p_idx, n0, n_keys, BLOCK_N: gl.constexpr, L_ROW: gl.constexpr):
        """The slots of the tile at ``n0`` (``-1`` from ``n_keys`` on) in the layout of the copies' rows."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_ROW))
        return gl.load(p_idx + o_n, mask=o_n < n_keys, other=-1)

    @gluon.jit
    def _mma_v2_issue(kv_ptr, b_slot, n_slots, PAGE: gl.constexpr, stride_page, stride_row, buf, L_ROW: gl.constexpr):
        """``cp.async`` of the bf16 rows of ``b_slot`` (row ``slot % PAGE`` of page ``slot // PAGE``) into ``buf``, one
        stage of :func:`mma_v2_key_ring` (four latent groups and the rope part; invalid slots zero-filled, never
        dereferenced); one commit group."""
        m_n = (b_slot >= 0) & (b_slot < n_slots)
        b_s = gl.where(m_n, b_slot, 0).to(gl.uint32)  # unsigned: no sign fix-ups in the division
        o_row = (b_s // PAGE).to(gl.int64) * stride_page + (b_s % PAGE).to(gl.int64) * stride_row
        p_row = gl.expand_dims(kv_ptr + o_row, 1)
        m_row = gl.expand_dims(m_n, 1)
        o_c = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_ROW)), 0)
        for g in gl.static_range(4):
            cp_async(buf[g], p_row + g * 128 + o_c, mask=m_row)
        o_cr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROW)), 0)
        cp_async(buf[4], p_row + 512 + o_cr, mask=m_row)
        async_copy.commit_group()

    @gluon.jit
    def mma_v2_store(p_out, b_acc, b_inv, m_h, SPLIT: gl.constexpr):
        """Write one normalised ``[BLOCK_H, 128]`` block of ``O`` (fp32 partial or final bf16)."""
        b_o = b_acc * b_inv
        if SPLIT:
            gl.store(p_out, b_o, mask=m_h)
        else:
            gl.store(p_out, b_o.to(gl.bfloat16), mask=m_h)

    @gluon.jit
    def _sparse_mla_mma_v2_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr, max_ptr,
        qk_scale,
        h_q, topk, n_slots, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, HAS_MAX: gl.constexpr,
        NUM_WARPS: gl.constexpr,
    ):
        gl.static_assert(STAGES >= 2)
        gl.static_assert(NUM_WARPS == 8)
        MMA: gl.constexpr = mma_v2_tile_layout()
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        # copies: 16 bytes a thread, a [32, 64] block per pass
        L_ROW: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        K_SL: gl.constexpr = mma_v2_keys_layout()
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        ROW_P: gl.constexpr = gl.SliceLayout(1, OP_A)

        # program (row, head block) of split i_s; the head blocks of a row are neighbours in the launch order
        n_hb = gl.cdiv(h_q, BLOCK_H)
        i_h = gl.program_id(0) % n_hb
        i_r = (gl.program_id(0) // n_hb).to(gl.int64)
        if SPLIT:
            i_s = gl.program_id(1)
        else:
            i_s = 0  # one split: the offsets below fold away
        n_end = topk
        if HAS_TOPK_LEN:
            n_end = gl.minimum(gl.maximum(gl.load(topk_len_ptr + gl.program_id(0) // n_hb // rows_per_batch), 0), topk)
        # this split's slots, counted from its first one: fewer values live across the loop
        n_start = i_s * keys_per_split
        n_keys = gl.minimum(n_start + keys_per_split, n_end) - n_start
        n_tiles = gl.cdiv(gl.maximum(n_keys, 0), BLOCK_N)
        p_idx = idx_ptr + i_r * stride_idx_row + n_start

        ring = mma_v2_key_ring(STAGES, BLOCK_N)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], K_SL)
        s_smem = mma_v2_scores_smem(BLOCK_H, BLOCK_N)

        for t in gl.static_range(STAGES - 1):
            b_slot = _mma_v2_slots(p_idx, t * BLOCK_N, n_keys, BLOCK_N, L_ROW)
            _mma_v2_issue(kv_ptr, b_slot, n_slots, PAGE, stride_page, stride_row, ring[t], L_ROW)
        # the slots of the next tile to copy are read an iteration ahead
        b_slot = _mma_v2_slots(p_idx, (STAGES - 1) * BLOCK_N, n_keys, BLOCK_N, L_ROW)

        # ---- q: the latent part into the registers of the A operand, through the last ring buffer (its first copy
        # is issued in the loop); the rope part stays in shared memory
        b_q0, b_q1, b_q2, b_q3 = mma_v2_load_q(q_ptr + i_r * stride_q_row, stride_q_head, i_h, h_q,
                                               ring[STAGES - 1][0], qr_smem, BLOCK_H, NUM_WARPS, OP_A)

        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW_P)
        b_l = gl.zeros([BLOCK_H], gl.float32, layout=ROW_P)
        b_acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
        o_n = gl.arange(0, BLOCK_N, layout=COL)
        b_idx = gl.load(p_idx + o_n, mask=o_n < n_keys, other=-1)
        # STAGES tiles an iteration, so that each tile's ring buffer is known when compiling (see mma_v2_key_ring)
        for j0 in range(0, n_tiles, STAGES):
            for st in gl.static_range(STAGES):
                j = j0 + st
                if j < n_tiles:
                    m_n = (b_idx >= 0) & (b_idx < n_slots)  # slots past the split were read as -1
                    o_n = o_n + BLOCK_N
                    b_idx = gl.load(p_idx + o_n, mask=o_n < n_keys, other=-1)
                    async_copy.wait_group(STAGES - 2)
                    # tile j landed for every thread; every warp is done with tile j - 1: its buffer and scores
                    cta_barrier()
                    jn = j + STAGES - 1
                    _mma_v2_issue(kv_ptr, b_slot, n_slots, PAGE, stride_page, stride_row,
                                  ring[(st + STAGES - 1) % STAGES], L_ROW)
                    b_slot = _mma_v2_slots(p_idx, (jn + 1) * BLOCK_N, n_keys, BLOCK_N, L_ROW)
                    buf = ring[st]
                    b_m, b_l, b_acc0, b_acc1, b_acc2, b_acc3 = mma_v2_attend_tile(
                        b_q0, b_q1, b_q2, b_q3, buf[0], buf[1], buf[2], buf[3], qr_smem, buf[4], s_smem, m_n, b_m, b_l,
                        b_acc0, b_acc1, b_acc2, b_acc3, b_zero, qk_scale, MMA, ROPE_CHAIN=True)
        async_copy.wait_group(0)

        # ---- epilogue. One split: natural-log lse (+inf without keys), max_logits, the sink's share, bf16 out.
        # Several: the split's base-2 lse (-inf without keys) and its normalised fp32 out, for the merge.
        b_m = gl.convert_layout(b_m, ROW)
        b_l = gl.convert_layout(b_l, ROW)
        m_empty = b_l == 0.0
        b_inv = 1.0 / gl.where(m_empty, 1.0, b_l)
        b_lse2 = gl.where(m_empty, float("-inf"), b_m + gl.log2(gl.where(m_empty, 1.0, b_l)))
        # (the row's batch and position and the split from the program ids again, fewer values live across the loop;
        # 32-bit divisions: a 64-bit one is a call, around which ptxas saves registers to local memory)
        i_r32 = gl.program_id(0) // n_hb
        if SPLIT:
            i_s = gl.program_id(1)
        i_b = (i_r32 // rows_per_batch).to(gl.int64)
        i_q = (i_r32 % rows_per_batch).to(gl.int64)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
        m_h = o_ho < h_q
        o_l = i_b * stride_lb + i_q * stride_lr + i_s * stride_ls + o_ho.to(gl.int64) * stride_lh
        if SPLIT:
            gl.store(lse_ptr + o_l, b_lse2, mask=m_h)
        else:
            b_lse = gl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
            if HAS_SINK:
                b_sink = gl.load(sink_ptr + o_ho, mask=m_h, other=0.0)
                # exp(lse) / (exp(lse) + exp(sink)); rows without keys have out = 0 already
                b_inv = b_inv / (1.0 + gl.exp(b_sink - gl.where(m_empty, 0.0, b_lse)))
            gl.store(lse_ptr + o_l, b_lse, mask=m_h)
            if HAS_MAX:
                gl.store(max_ptr + o_l, b_m * 0.6931471805599453, mask=m_h)
        b_inv = gl.expand_dims(b_inv, 1)
        m_ho = gl.expand_dims(m_h, 1)
        o_d = gl.expand_dims(gl.arange(0, 128, layout=COL), 0)
        # (the launchers' outputs hold their rows in order: stride_ob == rows_per_batch * stride_or)
        p_out = (out_ptr + i_r32.to(gl.int64) * stride_or + i_s * stride_os
                 + gl.expand_dims(o_ho.to(gl.int64) * stride_oh, 1) + o_d)
        mma_v2_store(p_out, b_acc0, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 128, b_acc1, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 256, b_acc2, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 384, b_acc3, b_inv, m_ho, SPLIT)


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int, arch: int | None) -> bool:
    """Whether :func:`flash_mla_sparse_fwd_mma_v2` can run this call: bf16 ``q`` and ``kv`` with ``d_qk`` 576 and
    ``d_v`` 512, rows 16-byte aligned for ``cp.async``, an arch of ``MMA_V2_PREFILL_ARCHS`` and Gluon allowed
    (``nsa_backend.kernels._gluon``)."""
    return gluon_rows_supported(q, kv, d_v) and gluon_enabled(arch, MMA_V2_PREFILL_ARCHS)


def flash_mla_sparse_fwd_mma_v2(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    stages: int = STAGES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.flash_mla_sparse_fwd` on the mma.sync archs (see :func:`supported`).

    Same parameters and results as ``nsa_backend.kernels.sparse_mla_prefill.flash_mla_sparse_fwd_triton``;
    ``stages`` overrides the ring's depth (three stages take 116 KiB: sm_80 only).
    """
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    kv2, idx = prefill_rows(kv, indices)
    # one split of whole tiles: never 1, so that Triton does not compile a trip count of one tile into the kernel for
    # a one-key list (Triton 3.6 folds the loop that takes STAGES tiles an iteration into a form its lowering rejects)
    keys_per_split = triton.cdiv(topk, BLOCK_N) * BLOCK_N
    cached_launcher(_sparse_mla_mma_v2_kernel)[(s_q * triton.cdiv(h_q, BLOCK_H), 1)](
        q, kv2, idx, attn_sink, topk_length, out, lse, max_logits,
        sm_scale * LOG2E, h_q, topk, s_kv, keys_per_split, 1,
        q.stride(0), q.stride(1), idx.stride(0), kv2.stride(0), 0,
        out.stride(0), out.stride(0), 0, out.stride(1),
        lse.stride(0), 0, 0, lse.stride(1),
        **constexprs(1, False, attn_sink is not None, topk_length is not None, True, stages),
    )
    return out, max_logits, lse


def constexprs(page: int, split: bool, has_sink: bool, has_topk_len: bool, has_max: bool,
               stages: int = STAGES) -> dict:
    """The kernel's compile-time arguments and launch options: ``page`` slots per page of ``kv`` (1 for the
    prefill's rows), ``split`` partials for the merge, ``has_max`` the prefill's ``max_logits``."""
    return dict(PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=stages, SPLIT=split, HAS_SINK=has_sink,
                HAS_TOPK_LEN=has_topk_len, HAS_MAX=has_max, NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS)


def kernel():
    """The Gluon kernel (ahead-of-time compiles)."""
    return _sparse_mla_mma_v2_kernel


__all__ = ["MMA_V2_PREFILL_ARCHS", "constexprs", "flash_mla_sparse_fwd_mma_v2", "kernel", "supported"]
