"""Warp-specialised Gluon sparse MLA decode over the "fp8_ds_mla" paged cache, 64 heads per program (sm_90).

Decoding ``B * s_q`` query rows is the prefill of that many rows over gathered fp8 cache rows, so this
kernel follows ``nsa_backend.kernels.sparse_mla_prefill.sm90_gluon``: one program (two compute warpgroups
and a 4-warp loader partition) handles one query row ``(b, s)``, ``BLOCK_H = 64`` heads and one split
of the row's top-k list (grid ``(head blocks, B * s_q, splits)``; the head blocks of a row are
neighbours in the launch order, so the second one finds the gathered rows in L2):

- the loader copies the ``q`` tile ``[64, 576]`` once into NVMMA-swizzled shared memory, then for
  each tile of ``BLOCK_N = 64`` slots the raw 656-byte token rows with ``cp.async``: the 512 e4m3
  bytes and the four fp32 group scales into staging buffers, the 64 bf16 rope values straight into
  an MMA-ready buffer. Two staging buffers: the rows of tile ``j + 1`` are in flight while tile ``j``
  is computed. Invalid slots (``< 0``, ``>= num_blocks * page_size``, past ``topk_length`` or the
  split) are zero-filled, never dereferenced, and their scores are ``-inf``;
- the compute warpgroups dequantise a tile (``bf16(e4m3 * scale)``, exactly as the reference) into
  one bf16 key buffer ``[64, 512]`` one 128-wide latent group at a time; each group's score MMA
  (``S = q K^T``, rope part first) runs while the next group is converted. ``O += P V`` (``V`` the
  latent part of the key buffer) follows; both products are warpgroup MMAs with operands in shared
  memory, laid out as in the prefill kernel (the two warpgroups side by side along N: 32 keys of the
  scores and 256 output columns each); online softmax in base 2, row sums reduced once after the
  loop. With ``LOADER_DQ`` the loader dequantises the last groups itself, in parallel;
- the loader and the compute warps meet on ``full`` (``cp.async`` arrivals) / ``empty`` mbarriers of
  the two staging buffers (and ``kfree`` / ``kready`` for the key buffer with ``LOADER_DQ``).

The top-k list is split over programs until they make one wave of one program per SM, or further where
that leaves part of the GPU idle (``configs.sparse_mla.wave_filling_splits``); the splits write normalised
fp32 partial outputs and base-2 lse that ``_sparse_mla_decode_merge_kernel`` combines. With one split the
kernel writes the final bf16 ``out``, the natural-log ``lse`` (``+inf`` for a row without a valid key) and
applies ``attn_sink``.

H200 (topk 2048, page 64, same process, CUDA graphs; bench/results/h200/tuning/sparse_mla_decode_ws.md):
h_q 128: B 128 246.0 / 489.0 us (s_q 1 / 2), B 32 74.9 / 128.4 us: 0.72-0.84x FlashMLA (the ``tl``
kernel 0.42-0.52x); h_q 64: B 128 127.8 / 251.8 us, B 32 47.7 / 76.1 us: 0.89-1.01x (``tl``
0.52-0.67x); h_q 32 (B 128, heads padded to 64) 121 us against 267 us for the ``tl`` kernel.
Converting the rows costs about a quarter of the time (a probe without it: 100 instead of 138 us at
B 128, h_q 64): the loader's share (``LOADER_DQ`` 2: 2-4 %) and 16-byte pieces per thread without
shared-memory bank conflicts on the swizzled key buffer (``DQ_VEC`` 8: 3-5 %) take part of it back.
With ``POW2_SCALES`` (``kv_scale_format="pow2"``) both partitions convert with the integer form of
``sparse_mla_decode_gluon._sparse_mla_decode_gluon_dequant`` (2 instead of 3 instructions per element,
the same keys): 1-2 % faster at 32 / 64 / 128 heads.
Tried without gain: converting the next tile's first groups while the ``P V`` MMA runs (a rotated
loop; leaving the ``P V`` MMA in flight across the loop's back edge instead makes ptxas serialise every
wgmma), other split counts than one wave at B 32 (where one wave leaves SMs idle, more splits gain:
``wave_filling_splits``).

Shared memory: ``q`` 72 KiB + key buffer 64 KiB + two staging buffers of 41 KiB (latent 32, rope 8,
scales 1) + ``P`` 8 KiB = 226 KiB (sm_90 allows 227).
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import wave_filling_splits
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._gluon import gluon_importable
from nsa_backend.kernels._launch import cached_launcher
from nsa_backend.kernels.sparse_mla_decode.merge import decode_outputs, launch_split_decode

# Whether the decode launcher takes this kernel where it is routed (``GLUON_WS_DECODE_MIN_HEADS``).
ENABLED = True
# Capabilities the kernel is written for (wgmma, 227 KiB of shared memory per block).
GLUON_WS_DECODE_ARCHS: tuple[int, ...] = (90,)
BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8
# Warps and registers per thread of the loader partition.
LOADER_WARPS = 4
LOADER_REGS = 64
# Latent groups (0-2 of 4) of each tile dequantised by the loader partition (the rest by the compute
# warps, at the same time).
LOADER_DQ = 2
# Contiguous elements per thread in the dequantisation (16: two 16-byte stores per row piece; 8: one,
# without shared-memory bank conflicts on the swizzled key buffer).
DQ_VEC = 8
D_QK = 576
D_V = 512
# Query rows per launch (the grid's second axis).
MAX_ROWS = 65535
LOG2E = 1.4426950408889634

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import (
        _sparse_mla_decode_gluon_dequant,
        _sparse_mla_decode_gluon_key_range,
        _sparse_mla_decode_gluon_lse,
    )
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


if gluon is not None:

    @gluon.jit
    def _sparse_mla_decode_ws_rows(p_idx, n0, n_stop, n_slots, page_size, stride_page, stride_row,
                                   BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """``[BN]`` byte offsets of the cache rows of positions ``n0 ..`` (0 for an invalid slot) and
        the validity mask, in ``layout``."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
        m_n = o_n < n_stop
        b_idx = gl.load(p_idx + o_n, mask=m_n, other=-1)
        m_n = m_n & (b_idx >= 0) & (b_idx < n_slots)
        b_slot = gl.where(m_n, b_idx, 0)
        o_row = ((b_slot // page_size).to(gl.int64) * stride_page
                 + (b_slot % page_size).to(gl.int64) * stride_row)
        return gl.multiple_of(o_row, 16), m_n

    @gluon.jit
    def _sparse_mla_decode_ws_dequant(lat, sc, layout: gl.constexpr, POW2_SCALES: gl.constexpr):
        """A staged ``[rows, 128]`` slice of e4m3 bytes ``lat`` with its ``[rows, 1]`` scales ``sc`` as bf16:
        ``bf16(e4m3 * scale)``, exactly as the reference (``_sparse_mla_decode_gluon_dequant``)."""
        return _sparse_mla_decode_gluon_dequant(lat.load(layout), sc.load(layout), POW2_SCALES)

    @gluon.jit
    def _sparse_mla_decode_ws_loader(
        q_ptr, kv_ptr, p_idx, i_r, i_h, h_q, n_start, n_stop, n_tiles, n_slots, page_size,
        stride_q_row, stride_q_head, stride_page, stride_row,
        q_smem, qr_smem, k_smem, lat_smem, sc_smem, rope_smem, q_bar, full_bars, empty_bars, kfree_bar,
        kready_bar,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, LOADER_DQ: gl.constexpr, DQ_VEC: gl.constexpr,
        POW2_SCALES: gl.constexpr,
    ):
        """Loader partition (4 warps): ``q`` once, then the raw rows of every tile into the staging
        buffer the compute warps released; each copy arrives on the buffer's ``full`` barrier. With
        ``LOADER_DQ`` > 0 it also dequantises the last ``LOADER_DQ`` latent groups of the previous tile
        into the key buffer (once the compute warps freed it: ``kfree``) and signals ``kready``."""
        L_G: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # u8 [BN, 128]
        L_R: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # bf16 [*, 64]
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])  # f32 [BN, 4]
        L_DQ: gl.constexpr = gl.BlockedLayout([1, DQ_VEC], [DQ_VEC // 4, 128 // DQ_VEC], [4, 1], [1, 0])
        DQ_ROWS: gl.constexpr = 16
        # ---- q [64, 576] (heads past h_q zero-filled)
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_R))
        o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, L_R))
        p_q = gl.expand_dims(q_ptr + i_r * stride_q_row + o_h.to(gl.int64) * stride_q_head, 1)
        p_q = p_q + gl.expand_dims(o_c, 0)
        m_q = gl.expand_dims(o_h < h_q, 1)
        for c in gl.static_range(8):
            cp_async(q_smem.slice(c * 64, 64, dim=1), p_q + c * 64, mask=m_q)
        cp_async(qr_smem, p_q + 512, mask=m_q)
        async_copy.mbarrier_arrive(q_bar, increment_count=False)

        o_g = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_G)), 0)
        o_sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC)), 0)
        for j in range(n_tiles + (LOADER_DQ > 0)):
            if j < n_tiles:
                st = j % 2
                n0 = n_start + j * BLOCK_N
                o_row, m_row = _sparse_mla_decode_ws_rows(p_idx, n0, n_stop, n_slots, page_size, stride_page,
                                                          stride_row, BLOCK_N, gl.SliceLayout(1, L_G))
                o_rs, m_rs = _sparse_mla_decode_ws_rows(p_idx, n0, n_stop, n_slots, page_size, stride_page,
                                                        stride_row, BLOCK_N, gl.SliceLayout(1, L_SC))
                # wait until the compute warps released this buffer (passes at once on its first use)
                mbarrier.wait(empty_bars.index(st), ((j // 2) & 1) ^ 1)
                # [BN, 512] e4m3 bytes, four 128-byte groups
                p_lat = gl.expand_dims(kv_ptr + o_row, 1) + o_g
                m_lat = gl.expand_dims(m_row, 1)
                lat = lat_smem.index(st)
                for g in gl.static_range(4):
                    cp_async(lat.slice(g * 128, 128, dim=1), p_lat + g * 128, mask=m_lat)
                # [BN, 64] bf16 rope values
                o_rr = gl.convert_layout(o_row, gl.SliceLayout(1, L_R))
                m_rr = gl.convert_layout(m_row, gl.SliceLayout(1, L_R))
                p_rope = (kv_ptr + o_rr + 528).to(gl.pointer_type(gl.bfloat16))
                cp_async(rope_smem.index(st), gl.expand_dims(p_rope, 1) + gl.expand_dims(o_c, 0),
                         mask=gl.expand_dims(m_rr, 1))
                # [BN, 4] fp32 group scales
                p_sc = (kv_ptr + o_rs + 512).to(gl.pointer_type(gl.float32))
                cp_async(sc_smem.index(st), gl.expand_dims(p_sc, 1) + o_sc, mask=gl.expand_dims(m_rs, 1))
                async_copy.mbarrier_arrive(full_bars.index(st), increment_count=False)
            if LOADER_DQ > 0:
                if j > 0:
                    # the last LOADER_DQ groups of tile t = j - 1, once its rows landed and the key
                    # buffer is free
                    t = j - 1
                    st_t = t % 2
                    mbarrier.wait(full_bars.index(st_t), (t // 2) & 1)
                    mbarrier.wait(kfree_bar, (t - 1) & 1, pred=t > 0)
                    lat_t = lat_smem.index(st_t)
                    sc_t = sc_smem.index(st_t)
                    for g in gl.static_range(4 - LOADER_DQ, 4):
                        for r in gl.static_range(BLOCK_N // DQ_ROWS):
                            b_k = _sparse_mla_decode_ws_dequant(
                                lat_t.slice(g * 128, 128, dim=1).slice(r * DQ_ROWS, DQ_ROWS, dim=0),
                                sc_t.slice(g, 1, dim=1).slice(r * DQ_ROWS, DQ_ROWS, dim=0), L_DQ, POW2_SCALES)
                            k_smem.slice(g * 128, 128, dim=1).slice(r * DQ_ROWS, DQ_ROWS, dim=0).store(b_k)
                    fence_async_shared()
                    cta_barrier()
                    mbarrier.arrive(kready_bar)

    @gluon.jit
    def _sparse_mla_decode_ws_compute(
        p_idx, n_start, n_stop, n_tiles, n_slots, qk_scale,
        q_smem, qr_smem, k_smem, lat_smem, sc_smem, rope_smem, p_smem, q_bar, full_bars, empty_bars,
        kfree_bar, kready_bar,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, LOADER_DQ: gl.constexpr,
        DQ_VEC: gl.constexpr, POW2_SCALES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    ):
        """Compute partition (two warpgroups): dequantisation, scores, softmax, ``P V``.

        The latent groups are dequantised one at a time, each group's score MMA running while the next
        group is converted; the last ``LOADER_DQ`` groups come from the loader partition (``kready``)."""
        L_DQ: gl.constexpr = gl.BlockedLayout([1, DQ_VEC], [DQ_VEC // 4, 128 // DQ_VEC], [8, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
        b_l2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        b_acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
        o_ns = gl.arange(0, BLOCK_N, layout=col_s)
        mbarrier.wait(q_bar, 0)
        for j in range(n_tiles):
            st = j % 2
            o_n = n_start + j * BLOCK_N + o_ns
            m_n = o_n < n_stop
            b_idx = gl.load(p_idx + o_n, mask=m_n, other=-1)
            m_n = m_n & (b_idx >= 0) & (b_idx < n_slots)
            mbarrier.wait(full_bars.index(st), (j // 2) & 1)
            lat = lat_smem.index(st)
            sc = sc_smem.index(st)
            # S [BH, BN] = q K^T
            fence_async_shared()
            b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
            b_s = warpgroup_mma(qr_smem, rope_smem.index(st).permute((1, 0)), b_s, use_acc=False,
                                is_async=True)
            for g in gl.static_range(4 - LOADER_DQ):
                k_g = k_smem.slice(g * 128, 128, dim=1)
                k_g.store(_sparse_mla_decode_ws_dequant(lat.slice(g * 128, 128, dim=1), sc.slice(g, 1, dim=1),
                                                        L_DQ, POW2_SCALES))
                fence_async_shared()
                cta_barrier()
                b_s = warpgroup_mma(q_smem.slice(g * 128, 128, dim=1), k_g.permute((1, 0)), b_s,
                                    is_async=True)
            if LOADER_DQ > 0:
                mbarrier.wait(kready_bar, j & 1)
                for g in gl.static_range(4 - LOADER_DQ, 4):
                    b_s = warpgroup_mma(q_smem.slice(g * 128, 128, dim=1),
                                        k_smem.slice(g * 128, 128, dim=1).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=[b_s])
            b_s = gl.where(gl.expand_dims(m_n, 0), b_s * qk_scale, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 1))
            b_alpha = gl.exp2(b_m - b_m_use)
            b_l2 = b_l2 * gl.expand_dims(b_alpha, 1) + b_p
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()
            # both warpgroups are done with the staging buffer: release it to the loader
            mbarrier.arrive(empty_bars.index(st))
            b_acc = b_acc * gl.expand_dims(gl.convert_layout(b_alpha, row_o), 1)
            b_acc = warpgroup_mma(p_smem, k_smem, b_acc, is_async=True)
            b_acc = warpgroup_mma_wait(0, deps=[b_acc])
            # both warpgroups are done with the key buffer and P
            cta_barrier()
            if LOADER_DQ > 0:
                mbarrier.arrive(kfree_bar)
        return b_acc, b_l2, b_m

    @gluon.jit
    def _sparse_mla_decode_ws_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr,
        qk_scale,
        h_q, topk, n_slots, page_size, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
        LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_DQ: gl.constexpr,
        DQ_VEC: gl.constexpr, POW2_SCALES: gl.constexpr,
    ):
        gl.static_assert(BLOCK_H == 64)
        gl.static_assert(BLOCK_N == 64)
        D_V: gl.constexpr = 512
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16])
        mma_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        raw_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

        i_h = gl.program_id(0)
        i_r = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        i_b = i_r // rows_per_batch
        i_q = i_r % rows_per_batch

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], mma_sl)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], mma_sl)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D_V], mma_sl)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], mma_sl)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], mma_sl)
        lat_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 512], raw_sl)
        sc_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, 4], raw_sl)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        full_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kfree_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kready_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # loader arrivals: one per loader thread when its copies land; release: one per tile
        mbarrier.init(q_bar, count=LOADER_WARPS * 32)
        for i in gl.static_range(2):
            mbarrier.init(full_bars.index(i), count=LOADER_WARPS * 32)
            mbarrier.init(empty_bars.index(i), count=1)
        # key buffer handed between the partitions (one arrival per tile)
        mbarrier.init(kfree_bar, count=1)
        mbarrier.init(kready_bar, count=1)
        fence_async_shared()

        n_start, n_stop, n_tiles = _sparse_mla_decode_gluon_key_range(topk_len_ptr, i_b, i_s, topk,
                                                                       keys_per_split, BLOCK_N, HAS_TOPK_LEN)
        p_idx = idx_ptr + i_r * stride_idx_row

        b_acc, b_l2, b_m = gl.warp_specialize([
            (_sparse_mla_decode_ws_compute, (p_idx, n_start, n_stop, n_tiles, n_slots, qk_scale,
                                             q_smem, qr_smem, k_smem, lat_smem, sc_smem, rope_smem, p_smem,
                                             q_bar, full_bars, empty_bars, kfree_bar, kready_bar,
                                             BLOCK_H, BLOCK_N, D_V, LOADER_DQ, DQ_VEC, POW2_SCALES, s_layout,
                                             o_layout)),
            (_sparse_mla_decode_ws_loader, (q_ptr, kv_ptr, p_idx, i_r, i_h, h_q, n_start, n_stop, n_tiles,
                                            n_slots, page_size, stride_q_row, stride_q_head, stride_page,
                                            stride_row, q_smem, qr_smem, k_smem, lat_smem, sc_smem, rope_smem,
                                            q_bar, full_bars, empty_bars, kfree_bar, kready_bar,
                                            BLOCK_H, BLOCK_N, LOADER_DQ, DQ_VEC, POW2_SCALES)),
        ], [LOADER_WARPS], [LOADER_REGS])

        # ---- epilogue
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        b_l = gl.sum(b_l2, axis=1)
        b_inv = _sparse_mla_decode_gluon_lse(b_m, b_l, sink_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q, stride_lb,
                                             stride_lr, stride_ls, stride_lh, BLOCK_H, SPLIT, HAS_SINK, row_s)
        b_o = b_acc * gl.expand_dims(gl.convert_layout(b_inv, row_o), 1)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
        o_co = gl.arange(0, D_V, layout=col_o)
        p_o = (out_ptr + i_b * stride_ob + i_q * stride_or + i_s * stride_os
               + gl.expand_dims(o_ho.to(gl.int64) * stride_oh, 1) + gl.expand_dims(o_co, 0))
        m_o = gl.expand_dims(o_ho < h_q, 1) & gl.expand_dims(o_co < D_V, 0)
        if SPLIT:
            gl.store(p_o, b_o, mask=m_o)
        else:
            gl.store(p_o, b_o.to(gl.bfloat16), mask=m_o)


def kernel():
    """The Gluon kernel; ``None`` when this Triton has no usable Gluon."""
    return _sparse_mla_decode_ws_kernel if gluon is not None else None


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether :func:`sparse_mla_decode_gluon_ws` can run this call (the caller checks ``gluon_enabled``).

    The fp8 cache only, ``d_qk = 576`` and ``d_v = 512``, 16-byte aligned cache rows and pages (the
    copies move 16 bytes at a time), ``q`` rows 16-byte aligned, at most ``MAX_ROWS`` query rows
    ``B * s_q`` and an sm_90 launch.
    """
    if kv_format != "fp8_ds_mla" or q.shape[-1] != D_QK or d_v != D_V or arch not in GLUON_WS_DECODE_ARCHS:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return False
    if q.data_ptr() % 16 or q.stride(-1) != 1 or q.stride(1) % 8 or q.stride(2) % 8:
        return False
    # query rows run on the grid's second axis
    return q.shape[2] > 0 and q.shape[0] * q.shape[1] <= MAX_ROWS


def plan(B: int, s_q: int, h_q: int, topk: int, num_sms: int,
         num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)``: a function of the shapes only.

    One program fills an SM's shared memory, so the top-k list is split until the programs of all
    rows and head blocks make one wave of one program per SM, or further where that leaves part of the
    GPU idle (``configs.sparse_mla.wave_filling_splits``).
    """
    return wave_filling_splits(B * s_q, triton.cdiv(h_q, BLOCK_H), topk, BLOCK_N, num_sms, num_splits)


def _constexprs(split: bool, has_sink: bool, has_topk_len: bool, pow2_scales: bool = False, **overrides) -> dict:
    return dict(BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, SPLIT=split, HAS_SINK=has_sink, HAS_TOPK_LEN=has_topk_len,
                LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, LOADER_DQ=LOADER_DQ,
                DQ_VEC=DQ_VEC, POW2_SCALES=pow2_scales) | overrides


def sparse_mla_decode_gluon_ws(
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
    options: dict | None = None,
    kv_scale_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.sparse_mla_decode` for the "fp8_ds_mla" cache on sm_90, 64 heads per program.

    Same parameters and results as ``sparse_mla_decode_triton``; the inputs must pass :func:`supported`.
    ``num_splits`` overrides the split of the top-k list of :func:`plan`; ``options`` overrides kernel
    constants (``LOADER_DQ``, ``DQ_VEC``, ``LOADER_REGS``). ``kv_scale_format="pow2"`` (the caller guarantees
    power-of-two scales) dequantises with integer bits and a bf16 multiply: the same keys with fewer
    instructions.
    """
    B, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    out, lse = decode_outputs(q, d_v)
    if B == 0 or s_q == 0:
        return out, lse
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    R = B * s_q
    idx = indices.view(R, topk)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    splits, per = plan(B, s_q, h_q, topk, device_sms(q.device, 8), num_splits)
    head_blocks = triton.cdiv(h_q, BLOCK_H)
    pow2 = kv_scale_format == "pow2"
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    launch_split_decode(
        cached_launcher(kernel()), head_blocks, splits, (q, kv_cache, idx), attn_sink, topk_length, out, lse, args,
        lambda split: dict(**_constexprs(split, attn_sink is not None and not split, topk_length is not None, pow2,
                                         **(options or {})), num_warps=NUM_WARPS),
    )
    return out, lse


def compile_for_sm90(split: bool = False, arch: int = 90, **options):
    """Compile the kernel ahead of time for ``sm_<arch>`` (no GPU needed) with the runtime's argument
    specialisation (16-byte aligned pointers and the strides the launcher requires); returns Triton's
    compiled kernel (``metadata.shared``: shared memory per program in bytes). Requires Gluon."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = kernel()
    names = fn.arg_names
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32", "topk_len_ptr": "*i32",
            "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32"}
    consts = _constexprs(split, not split, True, **options)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n == "qk_scale" else "i32"))
           for n in names}
    aligned = set(ptrs) | {"stride_q_row", "stride_q_head", "stride_idx_row", "stride_page", "stride_row"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in aligned}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})


__all__ = [
    "ENABLED", "GLUON_WS_DECODE_ARCHS", "compile_for_sm90", "kernel", "plan", "sparse_mla_decode_gluon_ws",
    "supported",
]
