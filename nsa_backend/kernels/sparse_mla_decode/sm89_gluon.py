"""Gluon sparse MLA decode over the "fp8_ds_mla" cache for the mma.sync archs (sm_80 / 86 / 89 / 120 / 121).

A program takes one query row ``(b, s)``, ``BLOCK_H = 32`` heads and one split of the row's top-k list
(grid ``(head blocks, B * s_q, splits)``: the head blocks of a row are neighbours in the launch order and
gather the same keys), ``BLOCK_N = 32`` slots per tile, eight warps:

- the latent part of ``q`` (``[32, 512]``) is loaded once into the registers of the MMA's ``A`` operand, where
  it stays for the whole split (the ``tl`` tile reads it from shared memory in every tile's product); its rope
  part stays in shared memory (16 registers fewer, so that the score MMAs interleave);
- the raw 656-byte rows of a tile (512 e4m3 bytes, four fp32 group scales, 64 bf16 rope values) come by
  ``cp.async``, from slots read one tile ahead of their copies (the three copies give a row to the same eight
  threads: one slot load, one page computation). Only the conversion reads the latent bytes and scales, so their
  ring of ``STAGES`` buffers takes tile ``j + STAGES`` right after the barrier that ends tile ``j``'s conversion,
  and those copies stay in flight through tile ``j``'s products; the rope values, which the products read, have a
  ring of their own, ``STAGES - 1`` tiles ahead. Invalid slots (``< 0``, ``>= num_blocks * page``, past
  ``topk_length`` or the split) are zero-filled and their scores ``-inf``;
- all threads convert a tile's latent bytes once into bf16 keys, one buffer and allocation per latent group
  (``bf16(e4m3 * scale)``, exactly as the reference; on sm_80 / 86, without the fp8 conversions, with integer
  operations), which both products read; sixteen threads take a row, eight bytes each, so that the 16-byte stores
  into the swizzled buffers meet no bank conflict;
- the warps form a 2 x 4 grid over ``S [32 heads, 32 keys]``: warp ``(m, n)`` computes heads ``16 m ..`` and
  keys ``8 n ..`` of the scores (four accumulators, one per latent group, so that the MMAs do not wait on each
  other), and no score is summed across warps. The scores pass through shared memory once (one barrier): each
  warp reads its head group's ``[16, 32]`` back in the layout of the ``A`` operand of ``P V``, and takes the
  max, ``P`` and the row sums there. For ``O [32, 512] += P V`` warp ``(m, n)`` holds heads ``16 m ..`` and
  every fourth 8-column slice of the latent dims. Three barriers per tile in all, with Triton 3.6, 3.8 and 3.9.
  The products and the softmax are ``mma_v2_attend_tile`` of ``sparse_mla_prefill/sm80_gluon.py``, which the bf16
  prefill shares; here with its lazy rescale (``LAZY_RESCALE``): a head's reference for the exponentials moves only
  where a tile's scores exceed it by more than 8 (base 2), and a warp whose heads all keep theirs skips ``O``'s
  products.

Outputs follow ``_sparse_mla_fwd_kernel``: with one split the final bf16 ``out``, the natural-log ``lse``
(``+inf`` for a row without a valid key) and ``attn_sink``; with several splits the normalised fp32
partials and base-2 lse that the merge kernel combines.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import wave_filling_splits
from nsa_backend.kernels._arch import device_arch, device_sms
from nsa_backend.kernels._gluon import gluon_importable
from nsa_backend.kernels._launch import cached_launcher
from nsa_backend.kernels.sparse_mla_decode import sm90_gluon as sm90
from nsa_backend.kernels.sparse_mla_decode.merge import decode_outputs, launch_split_decode
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E, e4m3_f16_dequant_ptx, fp8_native, pow2_dequant_ptx

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
    from nsa_backend.kernels.sparse_mla_prefill.sm80_gluon import (
        mma_v2_attend_tile,
        mma_v2_keys_layout,
        mma_v2_latent_smem,
        mma_v2_load_q,
        mma_v2_scores_smem,
        mma_v2_store,
        mma_v2_tile_layout,
    )
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None

# Architectures the kernel is written for: mma.sync, with the fp8 conversions from sm_89 on (``fp8_native``).
MMA_V2_DECODE_ARCHS: tuple[int, ...] = (80, 86, 89, 120, 121)
BLOCK_H = 32
BLOCK_N = 32
NUM_WARPS = 8
STAGES = 2
# Query rows a launch takes: the rows are the grid's second dimension.
MAX_ROWS = 65535
# The power-of-two dequantisation with an fma (sm_80 on).
_POW2_DEQUANT_PTX = triton.language.constexpr(pow2_dequant_ptx("fma"))
# The exact dequantisation with integer operations (sm_80 / 86).
_E4M3_F16_DEQUANT_PTX = triton.language.constexpr(e4m3_f16_dequant_ptx())


if gluon is not None:

    @triton.constexpr_function
    def mma_v2_dequant_layout(num_warps):
        """The conversion's register layout over ``[rows, 128]`` of a latent group: eight bytes a thread and sixteen
        threads a row, so that each eight-thread phase of a 16-byte store into the swizzled key rows covers eight
        bank groups (``tests/ops/test_mma_v2_banks.py``)."""
        return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    @gluon.jit
    def _decode_mma_v2_rows(b_idx, n_slots, PAGE: gl.constexpr, stride_page, stride_row):
        """Byte offsets of the cache rows of slots ``b_idx`` and their validity (page and row from the unsigned
        slot: no sign fix-ups in the division)."""
        m_n = (b_idx >= 0) & (b_idx < n_slots)
        b_slot = gl.where(m_n, b_idx, 0).to(gl.uint32)
        o_row = (b_slot // PAGE).to(gl.int64) * stride_page + (b_slot % PAGE).to(gl.int64) * stride_row
        # the launcher checks that the cache and its strides are 16-byte aligned
        return gl.multiple_of(o_row, 16), m_n

    @gluon.jit
    def _decode_mma_v2_slots(p_idx, n0, n_stop, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The slots of the tile at ``n0`` (``-1`` past ``n_stop``), one per row of the copies' layouts."""
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_LAT))
        return gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)

    @gluon.jit
    def _decode_mma_v2_issue_latent(kv_ptr, b_slot, n_slots, lat, sc, PAGE: gl.constexpr, stride_page, stride_row,
                                    NUM_WARPS: gl.constexpr):
        """``cp.async`` of the latent bytes and group scales of the slots ``b_slot`` (one tile's slots from
        ``_decode_mma_v2_slots``, ``-1`` past its end) into one buffer of their ring; one commit group. Returns the
        rows' byte offsets and validity, which the rope's copy of the same tile takes an iteration later.

        The copies give a row to the same eight threads (their layouts differ only in the columns a thread takes),
        so the row offsets are computed once and their layout conversions move nothing.
        """
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])
        o_row, m_n = _decode_mma_v2_rows(b_slot, n_slots, PAGE, stride_page, stride_row)
        c_lat = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, L_LAT)), 0)
        cp_async(lat, kv_ptr + gl.expand_dims(o_row, 1) + c_lat, mask=gl.expand_dims(m_n, 1))
        o_sc = gl.convert_layout(o_row, gl.SliceLayout(1, L_SC))
        m_sc = gl.convert_layout(m_n, gl.SliceLayout(1, L_SC))
        p_sc = (kv_ptr + o_sc + 512).to(gl.pointer_type(gl.float32))
        c_sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC)), 0)
        cp_async(sc, gl.expand_dims(p_sc, 1) + c_sc, mask=gl.expand_dims(m_sc, 1))
        async_copy.commit_group()
        return o_row, m_n

    @gluon.jit
    def _decode_mma_v2_issue_rope(kv_ptr, o_row, m_n, rope, NUM_WARPS: gl.constexpr):
        """``cp.async`` of the rope values of the rows ``o_row`` / ``m_n`` (from ``_decode_mma_v2_issue_latent``)
        into one buffer of their ring; one commit group."""
        L_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        o_rp = gl.convert_layout(o_row, gl.SliceLayout(1, L_ROPE))
        m_rp = gl.convert_layout(m_n, gl.SliceLayout(1, L_ROPE))
        p_rope = (kv_ptr + o_rp + 528).to(gl.pointer_type(gl.bfloat16))
        c_rp = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROPE)), 0)
        cp_async(rope, gl.expand_dims(p_rope, 1) + c_rp, mask=gl.expand_dims(m_rp, 1))
        async_copy.commit_group()

    @gluon.jit
    def _decode_mma_v2_dequant(b_raw, b_sg, POW2_SCALES: gl.constexpr, FP8_NATIVE: gl.constexpr):
        """``bf16(e4m3 * scale)`` (see ``sm90._sparse_mla_decode_gluon_dequant``; the power-of-two form with an
        fma instead of the sm_90 bf16 multiply). Without the fp8 conversions (sm_80 / 86) the bytes are decoded
        with integer operations (``e4m3_f16_dequant_ptx``)."""
        if POW2_SCALES:
            b_s16 = (b_sg * 1.329227995784916e36).to(gl.bfloat16)  # scale * 2^120
            return gl.inline_asm_elementwise(_POW2_DEQUANT_PTX, "=r,=r,r,r,r", [b_raw, b_s16], dtype=gl.bfloat16,
                                             is_pure=True, pack=4)
        if FP8_NATIVE:
            return (b_raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * b_sg).to(gl.bfloat16)
        return gl.inline_asm_elementwise(_E4M3_F16_DEQUANT_PTX, "=r,=r,r,r,r,r,r", [b_raw, b_sg * 256.0],
                                         dtype=gl.bfloat16, is_pure=True, pack=4)

    @gluon.jit
    def _decode_mma_v2_convert(lat, sc, g: gl.constexpr, k_g, POW2_SCALES: gl.constexpr, FP8_NATIVE: gl.constexpr,
                               L_DQ: gl.constexpr):
        """Latent group ``g`` of a raw tile (``lat`` / ``sc``: one ring buffer) into ``k_g`` as bf16."""
        b_raw = lat.slice(g * 128, 128, dim=1).load(L_DQ)
        b_sg = sc.slice(g, 1, dim=1).load(L_DQ)
        k_g.store(_decode_mma_v2_dequant(b_raw, b_sg, POW2_SCALES, FP8_NATIVE))

    @gluon.jit
    def _decode_mma_v2_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr,
        qk_scale,
        h_q, topk, n_slots, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, POW2_SCALES: gl.constexpr,
        FP8_NATIVE: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        gl.static_assert(STAGES >= 2)
        gl.static_assert(NUM_WARPS == 8)
        MMA: gl.constexpr = mma_v2_tile_layout()
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        L_DQ: gl.constexpr = mma_v2_dequant_layout(NUM_WARPS)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        K_SL: gl.constexpr = mma_v2_keys_layout()
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        ROW_P: gl.constexpr = gl.SliceLayout(1, OP_A)

        i_h = gl.program_id(0)
        i_r = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        n_start, n_stop, n_tiles = sm90._sparse_mla_decode_gluon_key_range(topk_len_ptr, i_r // rows_per_batch, i_s,
                                                                            topk, keys_per_split, BLOCK_N, HAS_TOPK_LEN)
        p_idx = idx_ptr + i_r * stride_idx_row

        lat_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, 4], RAW)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], K_SL)
        # the converted keys, one allocation per latent group: no barrier between the four groups' stores
        keys = mma_v2_latent_smem(BLOCK_N)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], K_SL)
        s_smem = mma_v2_scores_smem(BLOCK_H, BLOCK_N)

        # Only the conversion reads a tile's latent bytes and scales, so their buffer is free again right after the
        # conversion's barrier: tile j + STAGES's copies are issued there, and stay in flight while tile j's
        # products run. The rope values, which the products read, have a ring of their own, STAGES - 1 tiles ahead.
        # Commit groups in issue order: latent 0, then (rope t, latent t + 1) for every t.
        b_slot = _decode_mma_v2_slots(p_idx, n_start, n_stop, BLOCK_N, NUM_WARPS)
        o_row, m_row = _decode_mma_v2_issue_latent(kv_ptr, b_slot, n_slots, lat_smem.index(0), sc_smem.index(0),
                                                   PAGE, stride_page, stride_row, NUM_WARPS)
        for t in gl.static_range(STAGES - 1):
            _decode_mma_v2_issue_rope(kv_ptr, o_row, m_row, rope_smem.index(t), NUM_WARPS)
            b_slot = _decode_mma_v2_slots(p_idx, n_start + (t + 1) * BLOCK_N, n_stop, BLOCK_N, NUM_WARPS)
            o_row, m_row = _decode_mma_v2_issue_latent(kv_ptr, b_slot, n_slots, lat_smem.index(t + 1),
                                                       sc_smem.index(t + 1), PAGE, stride_page, stride_row,
                                                       NUM_WARPS)
        # the slots of the next tile to copy and of the tile to score are read an iteration ahead
        b_slot = _decode_mma_v2_slots(p_idx, n_start + STAGES * BLOCK_N, n_stop, BLOCK_N, NUM_WARPS)

        # ---- q: the latent part into the registers of the A operand (heads past h_q zero), through the first key
        # buffer; the rope part stays in shared memory (16 registers fewer, and the score MMAs then interleave)
        b_q0, b_q1, b_q2, b_q3 = mma_v2_load_q(q_ptr + i_r * stride_q_row, stride_q_head, i_h, h_q, keys[0],
                                               qr_smem, BLOCK_H, NUM_WARPS, OP_A)

        # running max (base 2) and sum of every head, in the layout of the rows of P
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW_P)
        b_l = gl.zeros([BLOCK_H], gl.float32, layout=ROW_P)
        b_acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
        b_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
        o_n = n_start + gl.arange(0, BLOCK_N, layout=COL)
        b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
        for j in range(n_tiles):
            st = j % STAGES
            m_n = (b_idx >= 0) & (b_idx < n_slots)  # slots past n_stop were read as -1
            o_n = o_n + BLOCK_N
            b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
            # tile j's latent and rope groups are in; later groups: latent j + 1 .. j + STAGES - 1, rope j + 1 ..
            async_copy.wait_group(2 * STAGES - 3)
            # tile j landed for every thread; every warp is done with tile j - 1: its keys, scores and rope buffer
            cta_barrier()
            _decode_mma_v2_issue_rope(kv_ptr, o_row, m_row, rope_smem.index((j + STAGES - 1) % STAGES), NUM_WARPS)
            lat = lat_smem.index(st)
            sc = sc_smem.index(st)
            for g in gl.static_range(4):
                _decode_mma_v2_convert(lat, sc, g, keys[g], POW2_SCALES, FP8_NATIVE, L_DQ)
            # every warp converted tile j: its latent buffer takes tile j + STAGES
            cta_barrier()
            o_row, m_row = _decode_mma_v2_issue_latent(kv_ptr, b_slot, n_slots, lat, sc, PAGE, stride_page,
                                                       stride_row, NUM_WARPS)
            b_slot = _decode_mma_v2_slots(p_idx, n_start + (j + STAGES + 1) * BLOCK_N, n_stop, BLOCK_N, NUM_WARPS)
            b_m, b_l, b_acc0, b_acc1, b_acc2, b_acc3 = mma_v2_attend_tile(
                b_q0, b_q1, b_q2, b_q3, keys[0], keys[1], keys[2], keys[3], qr_smem,
                rope_smem.index(st), s_smem, m_n, b_m, b_l, b_acc0, b_acc1, b_acc2, b_acc3, b_zero, qk_scale, MMA,
                LAZY_RESCALE=True)
        async_copy.wait_group(0)
        b_m = gl.convert_layout(b_m, ROW)
        b_l = gl.convert_layout(b_l, ROW)
        # (the row's batch and position from the program id again: fewer values live across the loop)
        i_r = gl.program_id(1).to(gl.int64)
        i_b = i_r // rows_per_batch
        i_q = i_r % rows_per_batch

        b_inv = sm90._sparse_mla_decode_gluon_lse(b_m, b_l, sink_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q, stride_lb,
                                                  stride_lr, stride_ls, stride_lh, BLOCK_H, SPLIT, HAS_SINK, ROW)
        b_inv = gl.expand_dims(b_inv, 1)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
        m_ho = gl.expand_dims(o_ho < h_q, 1)
        o_d = gl.expand_dims(gl.arange(0, 128, layout=COL), 0)
        p_out = (out_ptr + i_b * stride_ob + i_q * stride_or + i_s * stride_os
                 + gl.expand_dims(o_ho.to(gl.int64) * stride_oh, 1) + o_d)
        mma_v2_store(p_out, b_acc0, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 128, b_acc1, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 256, b_acc2, b_inv, m_ho, SPLIT)
        mma_v2_store(p_out + 384, b_acc3, b_inv, m_ho, SPLIT)


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether :func:`sparse_mla_decode_mma_v2` can run this call (the caller checks ``gluon_enabled``): the
    fp8 cache, ``d_qk = 576``, ``d_v = 512``, 16-byte aligned cache rows and pages, an arch of
    ``MMA_V2_DECODE_ARCHS``, at most ``MAX_ROWS`` query rows ``B * s_q`` (the grid's second dimension)."""
    if kv_format != "fp8_ds_mla" or q.shape[-1] != 576 or d_v != 512 or arch not in MMA_V2_DECODE_ARCHS:
        return False
    if q.shape[0] * q.shape[1] > MAX_ROWS:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return False
    return q.shape[2] > 0


def plan(B: int, s_q: int, h_q: int, topk: int, num_sms: int,
         num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)``: one program fills an SM's shared memory, so the top-k list is split
    until the programs of all rows and head blocks make one wave of one program per SM, or further where that
    leaves part of the GPU idle for the whole call (``wave_filling_splits``)."""
    return wave_filling_splits(B * s_q, triton.cdiv(h_q, BLOCK_H), topk, BLOCK_N, num_sms, num_splits)


def sparse_mla_decode_mma_v2(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    stages: int = STAGES,
    kv_scale_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.sparse_mla_decode` for the "fp8_ds_mla" cache on the mma.sync archs.

    Same parameters and results as ``sparse_mla_decode_triton``; the inputs must pass :func:`supported`.
    ``num_splits`` overrides the plan, ``stages`` the ring's depth; ``kv_scale_format="pow2"`` (the caller
    guarantees power-of-two scales) converts the keys with fewer instructions (same keys).
    """
    B, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    out, lse = decode_outputs(q, d_v)
    if B == 0:
        return out, lse
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    idx = indices.view(B * s_q, topk)
    splits, per = plan(B, s_q, h_q, topk, device_sms(q.device, 8), num_splits)
    common = dict(
        PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=stages, HAS_TOPK_LEN=topk_length is not None,
        POW2_SCALES=kv_scale_format == "pow2", NUM_WARPS=NUM_WARPS, FP8_NATIVE=fp8_native(device_arch(q.device)),
        num_warps=NUM_WARPS,
    )
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    launch_split_decode(cached_launcher(_decode_mma_v2_kernel), triton.cdiv(h_q, BLOCK_H), splits,
                        (q, kv_cache, idx), attn_sink, topk_length, out, lse, args,
                        lambda split: dict(SPLIT=split, HAS_SINK=attn_sink is not None and not split, **common))
    return out, lse


def kernel():
    """The Gluon kernel (ahead-of-time compiles)."""
    return _decode_mma_v2_kernel


__all__ = ["MMA_V2_DECODE_ARCHS", "kernel", "plan", "sparse_mla_decode_mma_v2", "supported"]
