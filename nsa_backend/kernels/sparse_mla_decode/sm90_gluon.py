"""Gluon sparse MLA decode over the "fp8_ds_mla" paged cache for sm_90 (split-K, merged as in ``tl``).

For a few heads per program the decode is bound by gathering and converting the cache rows, not by the
MMA arithmetic. The kernel is warp-specialised so that the gathers run ahead of the math:

- one program handles one query row ``(b, s)``, ``BLOCK_H`` heads and one split of the row's top-k
  list (grid ``(head blocks, B * s_q, splits)``; the head blocks of a row are neighbours in the launch
  order); ``q`` stays in shared memory;
- a 4-warp loader partition walks the split ``BLOCK_N = 64`` slots at a time and copies each tile's
  raw 656-byte token rows with asynchronous copies (``cp.async``) into a ring of ``STAGES`` staging
  buffers (512 e4m3 bytes, the four fp32 group scales, the 64 bf16 rope values straight into an
  MMA-ready buffer) as soon as the compute warps released a buffer, so up to ``STAGES`` tiles of
  gathers are in flight. Each tile's slot indices are read a tile ahead. Invalid slots (``< 0``,
  ``>= num_blocks * page_size``, past ``topk_length`` or the split) are zero-filled, never
  dereferenced, and their scores are ``-inf``. Loader and compute warps meet on ``full``
  (``cp.async`` arrivals) / ``empty`` mbarriers;
- the compute partition (two warpgroups) converts a tile's latent bytes (``bf16(e4m3 * scale)``,
  exactly as the reference) into one bf16 key buffer ``K [BLOCK_N, 512]`` in the MMA's shared layout;
  the warpgroup MMAs run transposed so that the keys fill the 64-row side and the few heads are the
  N side: ``S^T = K_nope q_nope^T + K_rope q_rope^T`` (``[BLOCK_N, BLOCK_H]``, heads split over the
  two warpgroups), online softmax over the keys in base 2, ``O^T += V^T P^T`` (``[512, BLOCK_H]``,
  ``V = K_nope``, latent dims split over the warpgroups), left running while the next tile is
  awaited. The staging buffer is released as soon as the scores are computed.

H200 (h_q 16, topk 2048, page 64, CUDA graphs, same process): B 128 117.4 / 232.3 us at s_q 1 / 2
(the previous single-partition kernel 128.7 / 253.5), B 32 40.6 / 68.2 us (44.9 / 74.7). Tried
without gain (``bench/results/h200/tuning/sparse_mla_gluon.md``): converting and starting the
scores group by group (more fences and barriers: 141 us at B 128), converting with integer
operations and the group scales applied outside the MMAs (no faster, and its scores differ from the
reference's rounded keys by more than the tolerance at large logits), two compute warpgroups each
owning half of the latent dims with the score halves exchanged through shared memory (119.4 us),
converting the next tile into registers while ``P V`` runs (0-3 %).

The "pair" kernel (``_sparse_mla_decode_gluon_pair_kernel``, 16-head blocks, from ``PAIR_MIN_ROWS``
programs per split on) stops reading every key tile twice for the scores: instead of splitting the heads
of one tile, each of its two compute warpgroups (two worker partitions of 4 warps, 216 registers)
takes every other tile of the split with its own key buffers (one per latent group, so that the
stores of the conversion need no barrier between them), its own scores ``S^T = K q^T`` for all 16
heads (m64n16), softmax, ``O^T``, max and row sums; the two states are merged once at the end through
shared memory (each partition's ``O^T`` over its own key buffers). The loader is the default
partition (80 registers): ``q`` once, then half tiles (32 slots) of latent bytes and scales into 3
half buffers, each refilled once the half that used it is converted (the first half of a tile goes back
before the second is converted: the loader runs at most 1.5 tiles ahead and waits on these releases),
and the rope values of a tile into 2 MMA-ready buffers, refilled once the scores of the tile that used
it are done. Its copies are
laid out so that 8 lanes copy 128 contiguous bytes of one row (2 rows per thread and half tile), with
the page and row of a slot from unsigned arithmetic: 267 instructions per tile instead of 794 when
each thread copied 16 bytes of 8 rows (the layout of the kernel above); the loader shares the SM
sub-partitions with the compute warps, and the loop time follows the instructions they issue. Shared
memory: 221,744 B. The ``P V`` MMAs are waited in the iteration that issues them (left in flight
across the back edge, ptxas serialises every wgmma). H200 (h_q 16, topk 2048, page 64, CUDA graphs,
same process, FlashMLA on heads padded to 64 in brackets): B 128 83.2 / 152.9 us at s_q 1 / 2 (114.0
/ 222.0), B 32 34.3 / 51.1 us with the split merge (47.6 / 73.9); releasing both halves after the
conversion instead 82.9-83.5 / 158.7-159.0 and 34.0-34.5 / 51.9-52.4; with the previous loader 95.3 /
176.9 and 40.9 / 59.9 (B 32 without the merge).
With ``POW2_SCALES`` (``kv_scale_format="pow2"``: the caller promises power-of-two scales) the keys are
converted with integer instructions and one bf16 multiply (same numbers, 2 instead of 3 instructions
per element, ``_sparse_mla_decode_gluon_dequant``): 75.3-76.4 / 146.9 us at B 128 and 32.0-32.4 / 46.7-47.9
us at B 32 against 82.1-82.8 / 154.5 and 35.0 / 51.2 (the first integer form, 2.5 instructions per
element: 78.2 / 148.1 and 32.7 / 48.9). Reading every conversion step's bytes before the previous step's keys
are stored (``_sparse_mla_decode_gluon_pair_dq_pow2``) then took 72.5 / 138.6 us at B 128 and 30.2 / 45.3 us at
B 32, against 76.5 / 147.1 and 31.9 / 47.7 (FlashMLA 114.6 / 222.1 and 47.1 / 74.2).
Below 32 programs per split the kernel above is faster (B 16 s_q 1: 28.9 against 30.9 us). Probes at
B 128 s_q 1 (parts removed, garbage data): no copies 80.8 us, no conversion 58.2: the compute warps
are the critical path. Tried without gain (``bench/results/h200/tuning/sparse_mla_gluon.md``):
converting and scoring group by group, 16 elements per thread in the conversion, 3 rope buffers,
an L2 bulk prefetch of the rows 2-8 tiles ahead (slower: 114-126 us), the MMAs of the two
partitions alternating in tile order, a separate converter partition feeding two MMA-only
partitions (99 us), an exact conversion with integer operations instead of the fp8 unit (the f16
with bits ``(b & 0x80) << 8 | (b & 0x7f) << 7`` is ``e4m3(b) * 2^-8``; half the ``F2FP`` but more
instructions: 114 us), one copied row per thread (64-byte runs: 89.8 us), the light layouts in the
kernel above (slower), releases by per-thread arrivals, rescaling ``O^T`` only when a max grew, a
fourth half buffer in place of a rope buffer (6-8 % slower), the scores' key operand converted
straight into the MMA's register fragment (1-2 % faster at three shapes, slower at B 128 s_q 2 than the
early release, and it permutes ``q``, the rope rows and the output), and the rope values gathered
into registers by the compute warps (9-11 % slower).

Outputs follow ``_sparse_mla_fwd_kernel``: with one split the final bf16 ``out``, the natural-log
``lse`` (``+inf`` for a row without a valid key) and ``attn_sink``; with several splits the
normalised fp32 partial outputs and base-2 lse that ``_sparse_mla_decode_merge_kernel`` combines.

Only sm_90 with Triton's Gluon dialect (see ``nsa_backend.kernels._gluon``) runs this kernel; the
caller falls back to the ``tl`` kernel elsewhere.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import wave_filling_splits
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._gluon import gluon_importable
from nsa_backend.kernels._launch import cached_launcher
from nsa_backend.kernels.sparse_mla_decode.merge import decode_outputs, launch_split_decode
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E, pow2_dequant_ptx

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None

# Architectures the kernel is written for.
GLUON_DECODE_ARCHS: tuple[int, ...] = (90,)
# The power-of-two dequantisation with the sm_90 bf16 multiply.
_POW2_DEQUANT_PTX = triton.language.constexpr(pow2_dequant_ptx("mul"))
# Warps of the compute partition (two warpgroups).
GLUON_DECODE_NUM_WARPS = 8
# Warps and registers per thread of the loader partition (96: no spills).
LOADER_WARPS = 4
LOADER_REGS = 96
# Whether 16-head blocks take the pair kernel (two compute warpgroups on alternate tiles) and its
# launch constants: half-tile staging buffers of latent bytes and scales, tile buffers of rope values,
# contiguous elements per thread in the conversion, registers per thread of each compute warpgroup
# (the loader partition gets the rest: 80 at 216, no spills; 224 spills in the loader).
PAIR = True
PAIR_OPTIONS: dict[str, int] = {"LAT_STAGES": 3, "ROPE_STAGES": 2, "DQ_VEC": 8, "COMPUTE_REGS": 216}
# The pair kernel from this many programs per split on (query rows times head blocks); fewer rows
# take the kernel above (H200, h_q 16: B 32 s_q 1 37.6 against 41.0 us, B 16 s_q 1 30.9 against 28.9).
PAIR_MIN_ROWS = 32


def _plan_default(h_q: int) -> tuple[int, int, int]:
    """``(block_h, block_n, stages)`` for ``h_q`` heads: three staging buffers for 16-head blocks, two
    for 32-head blocks (their ``q`` and ``P`` tiles leave no room for a third)."""
    return (16, 64, 3) if h_q <= 16 else (32, 64, 2)


if gluon is not None:

    @gluon.jit
    def _sparse_mla_decode_gluon_rows(b_idx, o_n, n_stop, n_slots, PAGE: gl.constexpr, stride_page, stride_row,
                                      UNSIGNED: gl.constexpr):
        """Byte offsets of the cache rows of slots ``b_idx`` (positions ``o_n``) and their validity; with
        ``UNSIGNED`` the page and row of a slot come from its unsigned value (no sign fix-ups in the division)."""
        m_n = (o_n < n_stop) & (b_idx >= 0) & (b_idx < n_slots)
        b_slot = gl.where(m_n, b_idx, 0)
        if UNSIGNED:
            b_slot = b_slot.to(gl.uint32)
        o_row = (b_slot // PAGE).to(gl.int64) * stride_page + (b_slot % PAGE).to(gl.int64) * stride_row
        # the launcher checks that the cache and its strides are 16-byte aligned
        return gl.multiple_of(o_row, 16), m_n

    @gluon.jit
    def _sparse_mla_decode_gluon_loader(
        kv_ptr, idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, stride_page, stride_row, stride_idx_row,
        lat_smem, sc_smem, rope_smem, full_bars, empty_bars,
        PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LW: gl.constexpr,
    ):
        """Loader partition: the raw rows of every tile into the staging buffer the consumers released;
        each thread's copies arrive on the buffer's ``full`` barrier when they land."""
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [LW, 1], [1, 0])
        L_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LW, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [LW, 1], [1, 0])
        p_idx = idx_ptr + i_r * stride_idx_row
        o_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_LAT))
        o_rp = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_ROPE))
        o_sc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_SC))
        c_lat = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, L_LAT)), 0)
        c_rp = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROPE)), 0)
        c_sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC)), 0)
        # the indices of a tile are read one tile ahead, in each copy's layout
        b_il = gl.load(p_idx + n_start + o_lat, mask=n_start + o_lat < n_stop, other=-1)
        b_ir = gl.load(p_idx + n_start + o_rp, mask=n_start + o_rp < n_stop, other=-1)
        b_is = gl.load(p_idx + n_start + o_sc, mask=n_start + o_sc < n_stop, other=-1)
        for j in range(n_tiles):
            st = j % STAGES
            n0 = n_start + j * BLOCK_N
            n1 = n0 + BLOCK_N
            c_il = b_il
            c_ir = b_ir
            c_is = b_is
            b_il = gl.load(p_idx + n1 + o_lat, mask=n1 + o_lat < n_stop, other=-1)
            b_ir = gl.load(p_idx + n1 + o_rp, mask=n1 + o_rp < n_stop, other=-1)
            b_is = gl.load(p_idx + n1 + o_sc, mask=n1 + o_sc < n_stop, other=-1)
            # wait until the compute warps released this buffer (passes at once on its first use)
            mbarrier.wait(empty_bars.index(st), ((j // STAGES) & 1) ^ 1)
            o_row, m_n = _sparse_mla_decode_gluon_rows(c_il, n0 + o_lat, n_stop, n_slots, PAGE, stride_page,
                                                       stride_row, False)
            p_lat = kv_ptr + gl.expand_dims(o_row, 1) + c_lat
            cp_async(lat_smem.index(st), p_lat, mask=gl.expand_dims(m_n, 1))
            o_row, m_n = _sparse_mla_decode_gluon_rows(c_ir, n0 + o_rp, n_stop, n_slots, PAGE, stride_page,
                                                       stride_row, False)
            p_rope = (kv_ptr + o_row + 528).to(gl.pointer_type(gl.bfloat16))
            cp_async(rope_smem.index(st), gl.expand_dims(p_rope, 1) + c_rp, mask=gl.expand_dims(m_n, 1))
            o_row, m_n = _sparse_mla_decode_gluon_rows(c_is, n0 + o_sc, n_stop, n_slots, PAGE, stride_page,
                                                       stride_row, False)
            p_sc = (kv_ptr + o_row + 512).to(gl.pointer_type(gl.float32))
            cp_async(sc_smem.index(st), gl.expand_dims(p_sc, 1) + c_sc, mask=gl.expand_dims(m_n, 1))
            async_copy.mbarrier_arrive(full_bars.index(st), increment_count=False)

    @gluon.jit
    def _sparse_mla_decode_gluon_compute(
        q_ptr, idx_ptr, i_r, i_h, h_q, n_start, n_stop, n_tiles, n_slots, qk_scale,
        stride_q_row, stride_q_head, stride_idx_row,
        lat_smem, sc_smem, rope_smem, k_smem, q_smem, qr_smem, p_smem, full_bars, empty_bars,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        """Compute partition (two warpgroups): conversion, scores, softmax, ``P V``."""
        L_DQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
        # S^T [BN, BH]: keys on the MMA's M side (one warpgroup's 64 rows), the heads split over the
        # warpgroups; O^T [128, BH] per latent group: latent dims on M, split over the warpgroups
        WG: gl.constexpr = NUM_WARPS // 4
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BLOCK_H // WG, 16])
        L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_KEY: gl.constexpr = gl.SliceLayout(1, L_S)

        # ---- q -> shared memory (zeros for heads past h_q)
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q))
        m_h = gl.expand_dims(o_h < h_q, 1)
        p_q = q_ptr + i_r * stride_q_row + gl.expand_dims(o_h.to(gl.int64) * stride_q_head, 1)
        o_qc = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_Q)), 0)
        for g in gl.static_range(4):
            q_smem.index(g).store(gl.load(p_q + g * 128 + o_qc, mask=m_h, other=0.0))
        o_qr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q)), 0)
        qr_smem.store(gl.load(p_q + 512 + o_qr, mask=m_h, other=0.0))
        fence_async_shared()
        cta_barrier()

        p_idx = idx_ptr + i_r * stride_idx_row
        o_nk = gl.arange(0, BLOCK_N, layout=L_KEY)
        o_n = n_start + o_nk
        b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_S))
        b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, L_S))
        b_acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        t_acc0 = warpgroup_mma_init(b_acc0)
        t_acc1 = warpgroup_mma_init(b_acc1)
        t_acc2 = warpgroup_mma_init(b_acc2)
        t_acc3 = warpgroup_mma_init(b_acc3)
        for i in range(n_tiles):
            st = i % STAGES
            m_n = (o_n < n_stop) & (b_idx >= 0) & (b_idx < n_slots)
            o_n = n_start + (i + 1) * BLOCK_N + o_nk
            b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
            mbarrier.wait(full_bars.index(st), (i // STAGES) & 1)
            lat = lat_smem.index(st)
            sc = sc_smem.index(st)
            # the previous tile's P V read K and P
            b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[t_acc0, t_acc1, t_acc2, t_acc3])
            cta_barrier()
            # bf16(e4m3 * scale) of the four latent groups
            for g in gl.static_range(4):
                b_sg = sc.slice(g, 1, dim=1).load(L_DQ)
                b_raw = lat.slice(g * 128, 128, dim=1).load(L_DQ)
                k_smem.index(g).store(_sparse_mla_decode_gluon_dequant(b_raw, b_sg, False))
            fence_async_shared()
            cta_barrier()
            # S^T [BN, BH]
            b_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
            for g in gl.static_range(4):
                b_s = warpgroup_mma(k_smem.index(g), q_smem.index(g).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(rope_smem.index(st), qr_smem.permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=[b_s])
            # both warpgroups are done with the staging buffer: release it to the loader
            cta_barrier()
            mbarrier.arrive(empty_bars.index(st))

            b_s = gl.where(gl.expand_dims(m_n, 1), b_s * qk_scale, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=0))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 0))
            b_alpha = gl.exp2(b_m - b_m_use)
            b_l = b_l * b_alpha + gl.sum(b_p, axis=0)
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()
            # O^T [512, BH] += V^T P^T
            b_a = gl.expand_dims(gl.convert_layout(b_alpha, gl.SliceLayout(0, L_O)), 0)
            t_acc0 = warpgroup_mma(k_smem.index(0).permute((1, 0)), p_smem, b_acc0 * b_a, is_async=True)
            t_acc1 = warpgroup_mma(k_smem.index(1).permute((1, 0)), p_smem, b_acc1 * b_a, is_async=True)
            t_acc2 = warpgroup_mma(k_smem.index(2).permute((1, 0)), p_smem, b_acc2 * b_a, is_async=True)
            t_acc3 = warpgroup_mma(k_smem.index(3).permute((1, 0)), p_smem, b_acc3 * b_a, is_async=True)
        b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[t_acc0, t_acc1, t_acc2, t_acc3])
        return b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l

    @gluon.jit
    def _sparse_mla_decode_gluon_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr,
        qk_scale,
        h_q, topk, n_slots, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
        NUM_WARPS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        WG: gl.constexpr = NUM_WARPS // 4
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BLOCK_H // WG, 16])
        L_OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NUM_WARPS], [0, 1])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.bfloat16)
        KR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
        QR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)

        # the head blocks of a row are neighbours in the launch order: they gather the same keys
        i_h = gl.program_id(0)
        i_r = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        i_b = i_r // rows_per_batch
        i_q = i_r % rows_per_batch

        # ---- shared memory
        lat_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, 4], RAW)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], KR_SL)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, 128], K_SL)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], QR_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], P_SL)
        full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # loader arrivals: one per loader thread when its copies land; release: one per tile
        for s in gl.static_range(STAGES):
            mbarrier.init(full_bars.index(s), count=LOADER_WARPS * 32)
            mbarrier.init(empty_bars.index(s), count=1)
        fence_async_shared()

        n_start, n_stop, n_tiles = _sparse_mla_decode_gluon_key_range(topk_len_ptr, i_b, i_s, topk,
                                                                       keys_per_split, BLOCK_N, HAS_TOPK_LEN)

        b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l = gl.warp_specialize([
            (_sparse_mla_decode_gluon_compute, (
                q_ptr, idx_ptr, i_r, i_h, h_q, n_start, n_stop, n_tiles, n_slots, qk_scale,
                stride_q_row, stride_q_head, stride_idx_row,
                lat_smem, sc_smem, rope_smem, k_smem, q_smem, qr_smem, p_smem, full_bars, empty_bars,
                BLOCK_H, BLOCK_N, STAGES, NUM_WARPS)),
            (_sparse_mla_decode_gluon_loader, (
                kv_ptr, idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, stride_page, stride_row,
                stride_idx_row, lat_smem, sc_smem, rope_smem, full_bars, empty_bars,
                PAGE, BLOCK_N, STAGES, LOADER_WARPS)),
        ], [LOADER_WARPS], [LOADER_REGS])

        _sparse_mla_decode_gluon_epilogue(
            b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l, sink_ptr, out_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q,
            stride_ob, stride_or, stride_os, stride_oh, stride_lb, stride_lr, stride_ls, stride_lh,
            BLOCK_H, SPLIT, HAS_SINK, L_S, L_OUT)

    @gluon.jit
    def _sparse_mla_decode_gluon_store(p_out, b_acc, b_inv, m_h, SPLIT: gl.constexpr, L_OUT: gl.constexpr):
        """Write one normalised [128, BLOCK_H] block of O^T (fp32 partial or final bf16)."""
        b_o = gl.convert_layout(b_acc, L_OUT) * b_inv
        if SPLIT:
            gl.store(p_out, b_o, mask=m_h)
        else:
            gl.store(p_out, b_o.to(gl.bfloat16), mask=m_h)

    # ---- two warpgroups on alternate tiles ("pair" kernel, 16-head blocks)

    # the f32 view of a key buffer that carries a partition's O^T block to the merge (the method is
    # ``_reinterpret`` before Triton 3.7)
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):

        @gluon.jit
        def _sparse_mla_decode_gluon_o_view(buf, BLOCK_H: gl.constexpr):
            O_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            return buf.reinterpret(gl.float32, [128, BLOCK_H], O_SL)
    else:

        @gluon.jit
        def _sparse_mla_decode_gluon_o_view(buf, BLOCK_H: gl.constexpr):
            O_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            return buf._reinterpret(gl.float32, [128, BLOCK_H], O_SL)

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_half(kv_ptr, c_il, c_is, o_lat, o_sc, c_lat, c_sc, n0, n_stop, n_slots,
                                           lat, sc, PAGE: gl.constexpr, stride_page, stride_row):
        """``cp.async`` of one half tile's latent bytes and group scales (invalid slots zero-filled)."""
        o_row, m_n = _sparse_mla_decode_gluon_rows(c_il, n0 + o_lat, n_stop, n_slots, PAGE, stride_page, stride_row,
                                                   True)
        cp_async(lat, kv_ptr + gl.expand_dims(o_row, 1) + c_lat, mask=gl.expand_dims(m_n, 1))
        o_row, m_n = _sparse_mla_decode_gluon_rows(c_is, n0 + o_sc, n_stop, n_slots, PAGE, stride_page, stride_row,
                                                   True)
        p_sc = (kv_ptr + o_row + 512).to(gl.pointer_type(gl.float32))
        cp_async(sc, gl.expand_dims(p_sc, 1) + c_sc, mask=gl.expand_dims(m_n, 1))

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_loader(
        q_ptr, kv_ptr, idx_ptr, i_r, i_h, h_q, n_start, n_stop, n_tiles, n_slots,
        stride_q_row, stride_q_head, stride_idx_row, stride_page, stride_row,
        q_smem, qr_smem, lat_smem, sc_smem, rope_smem, q_bar, lat_full, lat_empty, rope_full, rope_empty,
        PAGE: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr, LAT_STAGES: gl.constexpr,
        ROPE_STAGES: gl.constexpr, LW: gl.constexpr,
    ):
        """Loader partition (the default one) of the pair kernel: ``q`` once, then per tile the latent
        bytes and scales of its two halves of ``HALF`` slots into the ``LAT_STAGES`` half buffers and
        its rope values into the ``ROPE_STAGES`` MMA-ready buffers, each buffer as soon as the compute
        partition of its previous tile released it."""
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
        L_QR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LW, 1], [1, 0])
        # 128 contiguous bytes of a row per 8 lanes: two rows per thread and half tile
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LW, 1], [1, 0])
        L_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [LW, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [LW, 1], [1, 0])
        BLOCK_N: gl.constexpr = 2 * HALF
        # q [BLOCK_H, 576] (zeros for heads past h_q)
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q))
        p_q = q_ptr + i_r * stride_q_row + gl.expand_dims(o_h.to(gl.int64) * stride_q_head, 1)
        m_h = gl.expand_dims(o_h < h_q, 1)
        o_qc = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_Q)), 0)
        for g in gl.static_range(4):
            cp_async(q_smem.index(g), p_q + g * 128 + o_qc, mask=m_h)
        o_hr = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_QR))
        p_qr = q_ptr + i_r * stride_q_row + gl.expand_dims(o_hr.to(gl.int64) * stride_q_head, 1) + 512
        o_qr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_QR)), 0)
        cp_async(qr_smem, p_qr + o_qr, mask=gl.expand_dims(o_hr < h_q, 1))
        async_copy.mbarrier_arrive(q_bar, increment_count=False)

        p_idx = idx_ptr + i_r * stride_idx_row
        o_lat = gl.arange(0, HALF, layout=gl.SliceLayout(1, L_LAT))
        o_sc = gl.arange(0, HALF, layout=gl.SliceLayout(1, L_SC))
        o_rp = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_ROPE))
        c_lat = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, L_LAT)), 0)
        c_rp = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROPE)), 0)
        c_sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC)), 0)
        # the indices of a tile are read one tile ahead, in each copy's layout
        b_il0 = gl.load(p_idx + n_start + o_lat, mask=n_start + o_lat < n_stop, other=-1)
        b_il1 = gl.load(p_idx + n_start + HALF + o_lat, mask=n_start + HALF + o_lat < n_stop, other=-1)
        b_is0 = gl.load(p_idx + n_start + o_sc, mask=n_start + o_sc < n_stop, other=-1)
        b_is1 = gl.load(p_idx + n_start + HALF + o_sc, mask=n_start + HALF + o_sc < n_stop, other=-1)
        b_ir = gl.load(p_idx + n_start + o_rp, mask=n_start + o_rp < n_stop, other=-1)
        for j in range(n_tiles):
            n0 = n_start + j * BLOCK_N
            n1 = n0 + BLOCK_N
            c_il0 = b_il0
            c_il1 = b_il1
            c_is0 = b_is0
            c_is1 = b_is1
            c_ir = b_ir
            b_il0 = gl.load(p_idx + n1 + o_lat, mask=n1 + o_lat < n_stop, other=-1)
            b_il1 = gl.load(p_idx + n1 + HALF + o_lat, mask=n1 + HALF + o_lat < n_stop, other=-1)
            b_is0 = gl.load(p_idx + n1 + o_sc, mask=n1 + o_sc < n_stop, other=-1)
            b_is1 = gl.load(p_idx + n1 + HALF + o_sc, mask=n1 + HALF + o_sc < n_stop, other=-1)
            b_ir = gl.load(p_idx + n1 + o_rp, mask=n1 + o_rp < n_stop, other=-1)
            # half h of the split goes to buffer h % LAT_STAGES once the half before it there, h -
            # LAT_STAGES, is converted (lat_empty: one arrival per use of a buffer)
            h = 2 * j
            hs = h % LAT_STAGES
            mbarrier.wait(lat_empty.index(hs), ((h // LAT_STAGES) & 1) ^ 1, pred=h >= LAT_STAGES)
            _sparse_mla_decode_gluon_pair_half(kv_ptr, c_il0, c_is0, o_lat, o_sc, c_lat, c_sc, n0, n_stop, n_slots,
                                               lat_smem.index(hs), sc_smem.index(hs), PAGE, stride_page, stride_row)
            async_copy.mbarrier_arrive(lat_full.index(hs), increment_count=False)
            h = 2 * j + 1
            hs = h % LAT_STAGES
            mbarrier.wait(lat_empty.index(hs), ((h // LAT_STAGES) & 1) ^ 1, pred=h >= LAT_STAGES)
            _sparse_mla_decode_gluon_pair_half(kv_ptr, c_il1, c_is1, o_lat, o_sc, c_lat, c_sc, n0 + HALF, n_stop,
                                               n_slots, lat_smem.index(hs), sc_smem.index(hs), PAGE, stride_page,
                                               stride_row)
            async_copy.mbarrier_arrive(lat_full.index(hs), increment_count=False)
            # rope values of the whole tile
            rs = j % ROPE_STAGES
            mbarrier.wait(rope_empty.index(rs), ((j // ROPE_STAGES) & 1) ^ 1)
            o_row, m_n = _sparse_mla_decode_gluon_rows(c_ir, n0 + o_rp, n_stop, n_slots, PAGE, stride_page,
                                                       stride_row, True)
            p_rope = (kv_ptr + o_row + 528).to(gl.pointer_type(gl.bfloat16))
            cp_async(rope_smem.index(rs), gl.expand_dims(p_rope, 1) + c_rp, mask=gl.expand_dims(m_n, 1))
            async_copy.mbarrier_arrive(rope_full.index(rs), increment_count=False)

    @gluon.jit
    def _sparse_mla_decode_gluon_dequant(b_raw, b_sg, POW2_SCALES: gl.constexpr):
        """``bf16(e4m3 * scale)`` of the e4m3 bytes ``b_raw`` (``uint8 [rows, cols]``, 4 contiguous per
        thread) with their fp32 scales ``b_sg`` (``[rows, 1]``), exactly as the reference.

        Without ``POW2_SCALES``: fp8 unpack, f16 to f32, fp32 multiply, bf16 pack (3 instructions per
        element). With ``POW2_SCALES`` (the caller promises power-of-two scales below ``2^8``) the same numbers
        in 2: integer bits of ``e4m3 * 2^-120`` and one ``bf16x2`` multiply by ``bf16(scale * 2^120)``
        (``pow2_dequant_ptx``).
        """
        if POW2_SCALES:
            b_s16 = (b_sg * 1.329227995784916e36).to(gl.bfloat16)  # scale * 2^120
            return gl.inline_asm_elementwise(_POW2_DEQUANT_PTX, "=r,=r,r,r,r", [b_raw, b_s16], dtype=gl.bfloat16,
                                             is_pure=True, pack=4)
        return (b_raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * b_sg).to(gl.bfloat16)

    @gluon.jit
    def _sparse_mla_decode_gluon_pick(b0, b1, b2, b3, G: gl.constexpr):
        """``(b0, b1, b2, b3)[G]`` for a compile-time ``G``."""
        if G == 0:
            return b0
        elif G == 1:
            return b1
        elif G == 2:
            return b2
        else:
            return b3

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_dq_read(lat, sc, G: gl.constexpr, L_DQ: gl.constexpr):
        """The e4m3 bytes and scales of latent group ``G`` of a half tile, in registers."""
        return lat.slice(G * 128, 128, dim=1).load(L_DQ), sc.slice(G, 1, dim=1).load(L_DQ)

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_dq(lat, sc, k_smem, G: gl.constexpr, K: gl.constexpr, HALF: gl.constexpr,
                                         L_DQ: gl.constexpr):
        """Exact ``bf16(e4m3 * scale)`` of latent group ``G`` of one half tile into rows ``[K * HALF, (K + 1) *
        HALF)`` of that group's key buffer (``_sparse_mla_decode_gluon_dequant``)."""
        b_raw, b_sg = _sparse_mla_decode_gluon_pair_dq_read(lat, sc, G, L_DQ)
        k_smem.slice(K * HALF, HALF, dim=0).store(_sparse_mla_decode_gluon_dequant(b_raw, b_sg, False))

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_dq_pow2(lat_a, sc_a, lat_b, sc_b, k0, k1, k2, k3, full_b, phase_b, empty_a,
                                              HALF: gl.constexpr, L_DQ: gl.constexpr):
        """Power-of-two keys of a whole tile (half ``a`` into key rows ``[0, HALF)``, half ``b`` into ``[HALF,
        2 HALF)``, four latent groups each): waits for half ``b`` (``full_b``, ``phase_b``) and gives half ``a``
        back (``empty_a``) on the way.

        The bytes of each step are read before the keys of the step ahead of it are stored, across the two
        halves: ptxas does not move a shared-memory read above a shared-memory store, so in plain order every
        step waited for its reads (H200, h_q 16, same process: B 128 s_q 1 72.5 against 76.5 us, B 32 s_q 1
        30.2 against 31.9 us). The exact conversion keeps the plain order: its fp32 intermediates leave no
        registers for a second step (spills).
        """
        b_raw, b_sg = _sparse_mla_decode_gluon_pair_dq_read(lat_a, sc_a, 0, L_DQ)
        for i in gl.static_range(8):
            if i < 7:
                if i == 3:
                    mbarrier.wait(full_b, phase_b)
                if i < 3:
                    n_raw, n_sg = _sparse_mla_decode_gluon_pair_dq_read(lat_a, sc_a, i + 1, L_DQ)
                else:
                    n_raw, n_sg = _sparse_mla_decode_gluon_pair_dq_read(lat_b, sc_b, (i + 1) % 4, L_DQ)
            k_g = _sparse_mla_decode_gluon_pick(k0, k1, k2, k3, i % 4)
            k_g.slice((i // 4) * HALF, HALF, dim=0).store(_sparse_mla_decode_gluon_dequant(b_raw, b_sg, True))
            if i == 3:
                # every warp has read half a
                cta_barrier()
                mbarrier.arrive(empty_a)
            if i < 7:
                b_raw = n_raw
                b_sg = n_sg

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_compute(
        idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, qk_scale, stride_idx_row,
        lat_smem, sc_smem, rope_smem, k0_smem, k1_smem, k2_smem, k3_smem, q_smem, qr_smem, p_smem,
        q_bar, lat_full, lat_empty, rope_full, rope_empty,
        W: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr, LAT_STAGES: gl.constexpr,
        ROPE_STAGES: gl.constexpr, DQ_VEC: gl.constexpr, POW2_SCALES: gl.constexpr,
    ):
        """One compute warpgroup of the pair kernel: tiles ``W, W + 2, ...`` of the split, each converted
        into this warpgroup's key buffers (one per latent group), scored, softmaxed and multiplied
        into its own running ``O^T``, max and row sums."""
        BLOCK_N: gl.constexpr = 2 * HALF
        L_DQ: gl.constexpr = gl.BlockedLayout([1, DQ_VEC], [32 * DQ_VEC // 128, 128 // DQ_VEC], [4, 1], [1, 0])
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_KEY: gl.constexpr = gl.SliceLayout(1, L_S)

        p_idx = idx_ptr + i_r * stride_idx_row
        o_nk = gl.arange(0, BLOCK_N, layout=L_KEY)
        o_n = n_start + W * BLOCK_N + o_nk
        b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
        n_my = (n_tiles + 1 - W) // 2
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_S))
        # per-thread partial row sums, reduced once after the loop
        b_l2 = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
        b_acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        mbarrier.wait(q_bar, 0)
        for t in range(n_my):
            j = 2 * t + W
            m_n = (o_n < n_stop) & (b_idx >= 0) & (b_idx < n_slots)
            o_n = o_n + 2 * BLOCK_N
            b_idx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
            h0 = 2 * j
            # always 0 (j < 2^30): a loop-dependent buffer index keeps ptxas from holding the address of
            # every MMA operand in registers across the loop (it spilled them)
            kz = j >> 30
            hs0 = h0 % LAT_STAGES
            hs1 = (h0 + 1) % LAT_STAGES
            mbarrier.wait(lat_full.index(hs0), (h0 // LAT_STAGES) & 1)
            # every warp's part of the previous tile's P V is done with the key buffers and P
            cta_barrier()
            # bf16(e4m3 * scale) of both halves, four latent groups each; the first half goes back to the loader
            # once every warp has read it (the loader runs at most 1.5 tiles ahead, and waits on this)
            if POW2_SCALES:
                _sparse_mla_decode_gluon_pair_dq_pow2(
                    lat_smem.index(hs0), sc_smem.index(hs0), lat_smem.index(hs1), sc_smem.index(hs1),
                    k0_smem.index(0), k1_smem.index(0), k2_smem.index(0), k3_smem.index(0),
                    lat_full.index(hs1), ((h0 + 1) // LAT_STAGES) & 1, lat_empty.index(hs0), HALF, L_DQ)
            else:
                for k in gl.static_range(2):
                    if k == 1:
                        mbarrier.wait(lat_full.index(hs1), ((h0 + 1) // LAT_STAGES) & 1)
                    lat = lat_smem.index(hs1 if k == 1 else hs0)
                    sc = sc_smem.index(hs1 if k == 1 else hs0)
                    for g in gl.static_range(4):
                        _sparse_mla_decode_gluon_pair_dq(
                            lat, sc, _sparse_mla_decode_gluon_pick(k0_smem, k1_smem, k2_smem, k3_smem, g).index(0),
                            g, k, HALF, L_DQ)
                    if k == 0:
                        cta_barrier()
                        mbarrier.arrive(lat_empty.index(hs0))
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(lat_empty.index(hs1))
            rs = j % ROPE_STAGES
            mbarrier.wait(rope_full.index(rs), (j // ROPE_STAGES) & 1)
            # S^T [BN, BH]
            b_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
            b_s = warpgroup_mma(k0_smem.index(kz), q_smem.index(0).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(k1_smem.index(kz), q_smem.index(1).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(k2_smem.index(kz), q_smem.index(2).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(k3_smem.index(kz), q_smem.index(3).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(rope_smem.index(rs), qr_smem.permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=[b_s])

            b_s = gl.where(gl.expand_dims(m_n, 1), b_s * qk_scale, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=0))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 0))
            b_alpha = gl.exp2(b_m - b_m_use)
            b_l2 = b_l2 * gl.expand_dims(b_alpha, 0) + b_p
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()
            # every warp is past the score MMAs: release the rope buffer
            mbarrier.arrive(rope_empty.index(rs))
            # O^T [512, BH] += V^T P^T
            b_a = gl.expand_dims(gl.convert_layout(b_alpha, gl.SliceLayout(0, L_O)), 0)
            t_acc0 = warpgroup_mma(k0_smem.index(kz).permute((1, 0)), p_smem, b_acc0 * b_a, is_async=True)
            t_acc1 = warpgroup_mma(k1_smem.index(kz).permute((1, 0)), p_smem, b_acc1 * b_a, is_async=True)
            t_acc2 = warpgroup_mma(k2_smem.index(kz).permute((1, 0)), p_smem, b_acc2 * b_a, is_async=True)
            t_acc3 = warpgroup_mma(k3_smem.index(kz).permute((1, 0)), p_smem, b_acc3 * b_a, is_async=True)
            # waited here: an MMA left in flight across the loop's back edge makes ptxas serialise all
            # of them (while the other partition has its turn)
            b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[t_acc0, t_acc1, t_acc2, t_acc3])
        return b_acc0, b_acc1, b_acc2, b_acc3, b_m, gl.sum(b_l2, axis=0)

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_worker(
        idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, qk_scale, stride_idx_row,
        lat_smem, sc_smem, rope_smem, k0_smem, k1_smem, k2_smem, k3_smem, q_smem, qr_smem, p_smem, ml_smem,
        q_bar, lat_full, lat_empty, rope_full, rope_empty, merge_bar,
        W: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr, LAT_STAGES: gl.constexpr,
        ROPE_STAGES: gl.constexpr, DQ_VEC: gl.constexpr, POW2_SCALES: gl.constexpr,
    ):
        """A compute partition: its tiles, then its ``O^T`` (over its own key buffers, which no one reads
        any more), running max and sum into shared memory for the merge."""
        b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l = _sparse_mla_decode_gluon_pair_compute(
            idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, qk_scale, stride_idx_row,
            lat_smem, sc_smem, rope_smem, k0_smem, k1_smem, k2_smem, k3_smem, q_smem, qr_smem, p_smem,
            q_bar, lat_full, lat_empty, rope_full, rope_empty,
            W, BLOCK_H, HALF, LAT_STAGES, ROPE_STAGES, DQ_VEC, POW2_SCALES)
        cta_barrier()
        _sparse_mla_decode_gluon_o_view(k0_smem.index(0), BLOCK_H).store(b_acc0)
        _sparse_mla_decode_gluon_o_view(k1_smem.index(0), BLOCK_H).store(b_acc1)
        _sparse_mla_decode_gluon_o_view(k2_smem.index(0), BLOCK_H).store(b_acc2)
        _sparse_mla_decode_gluon_o_view(k3_smem.index(0), BLOCK_H).store(b_acc3)
        ml_smem.index(2 * W).store(b_m)
        ml_smem.index(2 * W + 1).store(b_l)
        cta_barrier()
        mbarrier.arrive(merge_bar)

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_merge(ka, kb, ml_smem, merge_bar, BLOCK_H: gl.constexpr, L_S: gl.constexpr):
        """Both compute partitions' states combined: one ``O^T`` block (over the key buffers ``ka`` /
        ``kb`` of the two partitions), the max and the sum."""
        mbarrier.wait(merge_bar, 0)
        b_m0 = ml_smem.index(0).load(gl.SliceLayout(0, L_S))
        b_l0 = ml_smem.index(1).load(gl.SliceLayout(0, L_S))
        b_m1 = ml_smem.index(2).load(gl.SliceLayout(0, L_S))
        b_l1 = ml_smem.index(3).load(gl.SliceLayout(0, L_S))
        b_m = gl.maximum(b_m0, b_m1)
        b_mu = gl.where(b_m == float("-inf"), 0.0, b_m)
        b_a0 = gl.exp2(b_m0 - b_mu)
        b_a1 = gl.exp2(b_m1 - b_mu)
        b_l = b_l0 * b_a0 + b_l1 * b_a1
        b_a0 = gl.expand_dims(b_a0, 0)
        b_a1 = gl.expand_dims(b_a1, 0)
        b_acc = (_sparse_mla_decode_gluon_o_view(ka.index(0), BLOCK_H).load(L_S) * b_a0
                 + _sparse_mla_decode_gluon_o_view(kb.index(0), BLOCK_H).load(L_S) * b_a1)
        return b_acc, b_m, b_l

    @gluon.jit
    def _sparse_mla_decode_gluon_pair_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr,
        qk_scale,
        h_q, topk, n_slots, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, LAT_STAGES: gl.constexpr,
        ROPE_STAGES: gl.constexpr, DQ_VEC: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr,
        HAS_TOPK_LEN: gl.constexpr, COMPUTE_REGS: gl.constexpr, POW2_SCALES: gl.constexpr,
    ):
        HALF: gl.constexpr = BLOCK_N // 2
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        ML_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.bfloat16)
        KR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
        QR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)

        i_h = gl.program_id(0)
        i_r = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        i_b = i_r // rows_per_batch
        i_q = i_r % rows_per_batch

        # ---- shared memory
        lat_smem = gl.allocate_shared_memory(gl.uint8, [LAT_STAGES, HALF, 512], RAW)
        sc_smem = gl.allocate_shared_memory(gl.float32, [LAT_STAGES, HALF, 4], RAW)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [ROPE_STAGES, BLOCK_N, 64], KR_SL)
        # one key buffer per latent group and compute partition (stores into different buffers need no
        # barrier between them)
        ka0 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        ka1 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        ka2 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        ka3 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        kb0 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        kb1 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        kb2 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        kb3 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 128], K_SL)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], QR_SL)
        p_smem0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], P_SL)
        p_smem1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], P_SL)
        ml_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], ML_SL)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        merge_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        lat_full = gl.allocate_shared_memory(gl.int64, [LAT_STAGES, 1], mbarrier.MBarrierLayout())
        lat_empty = gl.allocate_shared_memory(gl.int64, [LAT_STAGES, 1], mbarrier.MBarrierLayout())
        rope_full = gl.allocate_shared_memory(gl.int64, [ROPE_STAGES, 1], mbarrier.MBarrierLayout())
        rope_empty = gl.allocate_shared_memory(gl.int64, [ROPE_STAGES, 1], mbarrier.MBarrierLayout())
        # copies: one arrival per loader thread; releases: one per use of a buffer; merge: one per compute
        # partition
        mbarrier.init(q_bar, count=4 * 32)
        mbarrier.init(merge_bar, count=2)
        for s in gl.static_range(LAT_STAGES):
            mbarrier.init(lat_full.index(s), count=4 * 32)
        for s in gl.static_range(LAT_STAGES):
            mbarrier.init(lat_empty.index(s), count=1)
        for s in gl.static_range(ROPE_STAGES):
            mbarrier.init(rope_full.index(s), count=4 * 32)
            mbarrier.init(rope_empty.index(s), count=1)
        fence_async_shared()

        n_start, n_stop, n_tiles = _sparse_mla_decode_gluon_key_range(topk_len_ptr, i_b, i_s, topk,
                                                                       keys_per_split, BLOCK_N, HAS_TOPK_LEN)

        gl.warp_specialize([
            (_sparse_mla_decode_gluon_pair_loader, (
                q_ptr, kv_ptr, idx_ptr, i_r, i_h, h_q, n_start, n_stop, n_tiles, n_slots,
                stride_q_row, stride_q_head, stride_idx_row, stride_page, stride_row,
                q_smem, qr_smem, lat_smem, sc_smem, rope_smem, q_bar, lat_full, lat_empty, rope_full,
                rope_empty, PAGE, BLOCK_H, HALF, LAT_STAGES, ROPE_STAGES, 4)),
            (_sparse_mla_decode_gluon_pair_worker, (
                idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, qk_scale, stride_idx_row,
                lat_smem, sc_smem, rope_smem, ka0, ka1, ka2, ka3, q_smem, qr_smem, p_smem0, ml_smem,
                q_bar, lat_full, lat_empty, rope_full, rope_empty, merge_bar,
                0, BLOCK_H, HALF, LAT_STAGES, ROPE_STAGES, DQ_VEC, POW2_SCALES)),
            (_sparse_mla_decode_gluon_pair_worker, (
                idx_ptr, i_r, n_start, n_stop, n_tiles, n_slots, qk_scale, stride_idx_row,
                lat_smem, sc_smem, rope_smem, kb0, kb1, kb2, kb3, q_smem, qr_smem, p_smem1, ml_smem,
                q_bar, lat_full, lat_empty, rope_full, rope_empty, merge_bar,
                1, BLOCK_H, HALF, LAT_STAGES, ROPE_STAGES, DQ_VEC, POW2_SCALES)),
        ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])
        b_acc0, b_m, b_l = _sparse_mla_decode_gluon_pair_merge(ka0, kb0, ml_smem, merge_bar, BLOCK_H, L_S)
        b_acc1, b_m, b_l = _sparse_mla_decode_gluon_pair_merge(ka1, kb1, ml_smem, merge_bar, BLOCK_H, L_S)
        b_acc2, b_m, b_l = _sparse_mla_decode_gluon_pair_merge(ka2, kb2, ml_smem, merge_bar, BLOCK_H, L_S)
        b_acc3, b_m, b_l = _sparse_mla_decode_gluon_pair_merge(ka3, kb3, ml_smem, merge_bar, BLOCK_H, L_S)

        _sparse_mla_decode_gluon_epilogue(
            b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l, sink_ptr, out_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q,
            stride_ob, stride_or, stride_os, stride_oh, stride_lb, stride_lr, stride_ls, stride_lh,
            BLOCK_H, SPLIT, HAS_SINK, L_S, L_OUT)

    @gluon.jit
    def _sparse_mla_decode_gluon_key_range(topk_len_ptr, i_b, i_s, topk, keys_per_split, BLOCK_N: gl.constexpr,
                                           HAS_TOPK_LEN: gl.constexpr):
        """``(n_start, n_stop, n_tiles)``: the slots of the top-k list that split ``i_s`` of batch ``i_b``
        reads (truncated by ``topk_length``) and their number of ``BLOCK_N`` tiles."""
        n_end = topk
        if HAS_TOPK_LEN:
            n_end = gl.minimum(gl.maximum(gl.load(topk_len_ptr + i_b), 0), topk)
        n_start = i_s * keys_per_split
        n_stop = gl.minimum(n_start + keys_per_split, n_end)
        n_tiles = gl.cdiv(gl.maximum(n_stop - n_start, 0), BLOCK_N)
        return n_start, n_stop, n_tiles

    @gluon.jit
    def _sparse_mla_decode_gluon_lse(b_m, b_l, sink_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q, stride_lb, stride_lr,
                                     stride_ls, stride_lh, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                                     HAS_SINK: gl.constexpr, L_H: gl.constexpr):
        """Store the lse of head block ``i_h`` (``L_H``: the layout of ``b_m`` / ``b_l``; base 2 for a split's
        partials, else natural log with ``+inf`` for a row without keys) from the running max ``b_m``
        (base 2) and sum ``b_l``; return the factor that normalises the output (``1 / b_l``, times the
        sink's share without splits)."""
        m_empty = b_l == 0.0
        b_inv = 1.0 / gl.where(m_empty, 1.0, b_l)
        b_lse2 = gl.where(m_empty, float("-inf"), b_m + gl.log2(gl.where(m_empty, 1.0, b_l)))
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=L_H)
        m_h = o_h < h_q
        o_l = i_b * stride_lb + i_q * stride_lr + i_s * stride_ls + o_h.to(gl.int64) * stride_lh
        if SPLIT:
            gl.store(lse_ptr + o_l, b_lse2, mask=m_h)
        else:
            b_lse = gl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
            if HAS_SINK:
                b_sink = gl.load(sink_ptr + o_h, mask=m_h, other=0.0)
                b_inv = b_inv / (1.0 + gl.exp(b_sink - gl.where(m_empty, 0.0, b_lse)))
            gl.store(lse_ptr + o_l, b_lse, mask=m_h)
        return b_inv

    @gluon.jit
    def _sparse_mla_decode_gluon_epilogue(
        b_acc0, b_acc1, b_acc2, b_acc3, b_m, b_l, sink_ptr, out_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q,
        stride_ob, stride_or, stride_os, stride_oh, stride_lb, stride_lr, stride_ls, stride_lh,
        BLOCK_H: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, L_S: gl.constexpr,
        L_OUT: gl.constexpr,
    ):
        """Normalise ``O^T`` and write ``out`` / ``lse`` (or the split's partials)."""
        b_inv = _sparse_mla_decode_gluon_lse(b_m, b_l, sink_ptr, lse_ptr, i_h, i_b, i_q, i_s, h_q, stride_lb,
                                             stride_lr, stride_ls, stride_lh, BLOCK_H, SPLIT, HAS_SINK,
                                             gl.SliceLayout(0, L_S))
        b_inv_o = gl.expand_dims(gl.convert_layout(b_inv, gl.SliceLayout(0, L_OUT)), 0)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, L_OUT))
        m_ho = gl.expand_dims(o_ho < h_q, 0)
        o_d = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(1, L_OUT)), 1)
        p_out = (out_ptr + i_b * stride_ob + i_q * stride_or + i_s * stride_os
                 + gl.expand_dims(o_ho.to(gl.int64) * stride_oh, 0) + o_d)
        _sparse_mla_decode_gluon_store(p_out, b_acc0, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 128, b_acc1, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 256, b_acc2, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 384, b_acc3, b_inv_o, m_ho, SPLIT, L_OUT)


def gluon_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int,
                           arch: int | None) -> bool:
    """Whether :func:`sparse_mla_decode_gluon` can run this call (the caller checks ``gluon_enabled``).

    The fp8 cache only, ``d_qk = 576`` and ``d_v = 512``, 16-byte aligned cache rows and pages (the
    copies move 16 bytes at a time) and an sm_90 launch.
    """
    if kv_format != "fp8_ds_mla" or q.shape[-1] != 576 or d_v != 512 or arch not in GLUON_DECODE_ARCHS:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return False
    return q.shape[2] > 0


def decode_gluon_plan(B: int, s_q: int, h_q: int, topk: int, num_sms: int, block_h: int | None = None,
                      block_n: int | None = None, stages: int | None = None,
                      num_splits: int | None = None) -> tuple[int, int, int, int, int]:
    """``(block_h, block_n, stages, num_splits, keys_per_split)``: a function of the shapes only.

    One program fills an SM's shared memory, so the top-k list is split until the programs of all rows and
    head blocks make one wave of one program per SM, or further where that leaves part of the GPU idle
    (``configs.sparse_mla.wave_filling_splits``).
    """
    bh, bn, _ = _plan_default(h_q)
    bh, bn = block_h or bh, block_n or bn
    st = stages or _plan_default(bh)[2]
    splits, per = wave_filling_splits(B * s_q, triton.cdiv(h_q, bh), topk, bn, num_sms, num_splits)
    return bh, bn, st, splits, per


def sparse_mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    stages: int | None = None,
    num_splits: int | None = None,
    pair: bool | None = None,
    pair_options: dict[str, int] | None = None,
    kv_scale_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.sparse_mla_decode` for the "fp8_ds_mla" cache on sm_90.

    Same parameters and results as ``sparse_mla_decode_triton``; the inputs must pass
    :func:`gluon_decode_supported`. ``block_h``, ``block_n``, ``stages`` and ``num_splits`` override
    the plan of :func:`decode_gluon_plan`; ``pair`` forces (``True``: 16-head blocks of 64 keys
    and no ``stages``, else ``ValueError``) or avoids the pair kernel, which by default takes 16-head
    blocks from ``PAIR_MIN_ROWS`` programs per split on when no ``stages`` are given; ``pair_options``
    overrides entries of ``PAIR_OPTIONS`` for the pair kernel (``ValueError`` for other keys, or where the
    pair kernel does not run). ``kv_scale_format="pow2"`` (the caller guarantees power-of-two scales) lets
    the pair kernel dequantise with a bf16 multiply: the same keys with fewer instructions.
    """
    B, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    out, lse = decode_outputs(q, d_v)
    if B == 0:
        return out, lse
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    R = B * s_q
    idx = indices.view(R, topk)
    bh, bn, st, splits, per = decode_gluon_plan(B, s_q, h_q, topk, device_sms(q.device, 8), block_h, block_n,
                                                stages, num_splits)
    head_blocks = triton.cdiv(h_q, bh)
    if pair is None:
        pair = PAIR and stages is None and (bh, bn) == (16, 64) and R * head_blocks >= PAIR_MIN_ROWS
    elif pair and ((bh, bn) != (16, 64) or stages is not None):
        raise ValueError(f"pair=True runs 16-head blocks of 64 keys with its own staging; got block_h={bh}, "
                         f"block_n={bn}, stages={stages}")
    if pair_options is not None:
        unknown = sorted(set(pair_options) - set(PAIR_OPTIONS))
        if unknown or not pair:
            raise ValueError(f"pair_options: keys among {sorted(PAIR_OPTIONS)} for the pair kernel; got "
                             f"{sorted(pair_options)} with pair={pair}")
    if pair:
        kernel = _sparse_mla_decode_gluon_pair_kernel
        common = dict(
            PAGE=page, BLOCK_H=bh, BLOCK_N=bn,
            **{**PAIR_OPTIONS, **(pair_options or {})},
            HAS_TOPK_LEN=topk_length is not None, POW2_SCALES=kv_scale_format == "pow2", num_warps=4,
        )
    else:
        kernel = _sparse_mla_decode_gluon_kernel
        common = dict(
            PAGE=page, BLOCK_H=bh, BLOCK_N=bn, STAGES=st, HAS_TOPK_LEN=topk_length is not None,
            NUM_WARPS=GLUON_DECODE_NUM_WARPS,
            LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=GLUON_DECODE_NUM_WARPS,
        )
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    launch_split_decode(cached_launcher(kernel), head_blocks, splits, (q, kv_cache, idx), attn_sink, topk_length,
                        out, lse, args,
                        lambda split: dict(SPLIT=split, HAS_SINK=attn_sink is not None and not split, **common))
    return out, lse
