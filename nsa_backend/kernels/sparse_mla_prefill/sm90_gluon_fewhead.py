"""Gluon sparse MLA prefill for a few heads (``h_q <= 32``) on sm_90: keys on the MMA's M side.

:func:`flash_mla_sparse_fwd_gluon_fewhead` computes :func:`nsa_backend.flash_mla_sparse_fwd` for bf16
``q`` / ``kv`` with ``d_qk`` 576 (512 latent + 64 rope), ``d_v`` 512 and up to 32 heads; the launcher
in ``nsa_backend.kernels.sparse_mla_prefill`` calls it when :func:`supported` says so. With so few heads
the 64-head kernels pad every MMA to 64 heads; here no padded-head MMA work is done:

- a program walks query rows ``pid, pid + G, ...`` (``G`` programs, see :func:`fewhead_plan`; by
  default one program per row), one row with all its heads (``BLOCK_H`` = 16 or 32, padded heads
  masked) at a time;
- the warpgroup MMAs run transposed, with the keys on the 64-row side and the heads on the N side:
  ``S^T = K_nope q_nope^T + K_rope q_rope^T`` (``[64 keys, BLOCK_H]``), online softmax per head over
  the keys in base 2, ``O^T += V^T P^T`` (``[512, BLOCK_H]`` as four ``[128, BLOCK_H]`` accumulators;
  ``V^T`` is the permuted view of the key buffer, ``P^T`` goes through a ``[64, BLOCK_H]`` shared
  tile); one compute warpgroup;
- the keys of a 64-key tile are four latent groups of 128 columns, each in one slot of a ring of
  ``SLOTS`` ``[64, 128]`` buffers (NVMMA layout), and the rope part in a ring of ``ROPE_STAGES``
  ``[64, 64]`` buffers. A loader partition copies the rows (``cp.async``, 16 bytes per copy, invalid
  slots zero-filled and never dereferenced) into every slot as soon as the compute warpgroup released
  it, running ahead into the program's next query row. Loader and compute warps meet on ``full``
  (``cp.async`` arrivals) / ``empty`` mbarriers; ``q`` is copied per row by the compute warpgroup.

One warpgroup issues 68 MMAs per 64-key tile whatever the head count (36 for ``S^T``, 32 for ``O^T``),
and on its own it does not keep the tensor cores busy. So two programs share an SM (one tile of keys
each, and one group of the next with 16 heads: 111 / 113 KB of shared memory at 16 / 32 heads, 128
registers per thread at launch): one program's MMAs run while the other waits for its gathers or
computes its softmax. The shared-memory views of ``q`` and ``P`` are indexed by a run-time zero
(``zero``) so that the compiler forms their MMA descriptors per tile instead of keeping all of them in
registers across the loop (which spilled). H200 (s_q 4096, s_kv 32768, topk 2048): 1.340 / 1.695 ms at
h_q 16 / 32, against 1.79 / 1.80-1.86 ms for FlashMLA on heads padded to 64 and 2.38 / 2.52 ms for the
previous routes (``bench/results/h200/tuning/sparse_mla_prefill_fewhead.md``). Tried without gain
there: issuing the next tile's scores before the softmax (ptxas serialises the MMAs: twice the time),
two compute warpgroups splitting the heads of ``S^T`` and the latent dims of ``O^T``, one program per
SM with more slots, two row streams in one program.

Outputs follow the op exactly: natural-log ``lse`` (``+inf`` and ``out = 0`` for a row without a
valid key), ``max_logits`` (``-inf`` then), ``attn_sink`` scaling by ``1 / (1 + exp(sink - lse))``,
``topk_length`` (``[s_q]``) truncating each row's list, indices ``< 0`` or ``>= s_kv`` skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from nsa_backend.kernels._gluon import gluon_importable

# The capabilities (GLUON_ARCHS) and row shapes (d_qk 576, d_v 512, rows_supported) are the 64-head kernel's.
from nsa_backend.kernels.sparse_mla_prefill.common import prefill_outputs, prefill_rows
from nsa_backend.kernels.sparse_mla_prefill.sm90_gluon import GLUON_ARCHS, rows_supported

# Whether the prefill launcher takes this kernel where :func:`supported` allows it.
ENABLED = True
MAX_HEADS = 32
BLOCK_N = 64
# Warps of the compute partition (one warpgroup).
NUM_WARPS = 4
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
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


if gluon is not None:

    @gluon.jit
    def _sparse_mla_fewhead_row_keys(topk_len_ptr, i_r, topk, HAS_TOPK_LEN: gl.constexpr):
        """Number of leading indices row ``i_r`` uses."""
        n_end = topk
        if HAS_TOPK_LEN:
            n_end = gl.minimum(gl.maximum(gl.load(topk_len_ptr + i_r), 0), topk)
        return n_end

    @gluon.jit
    def _sparse_mla_fewhead_loader(
        kv_ptr, idx_ptr, topk_len_ptr, s_q, topk, s_kv, stride_idx_row, stride_kv,
        k_ring, r_ring, full_bars, empty_bars,
        BLOCK_N: gl.constexpr, SLOTS: gl.constexpr, ROPE_STAGES: gl.constexpr,
        HAS_TOPK_LEN: gl.constexpr, LW: gl.constexpr,
    ):
        """Loader partition: the rows of every key tile, group by group, into the slots the compute
        warpgroup released; each thread's copies arrive on the slot's ``full`` barrier when they land."""
        L_G: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LW, 1], [1, 0])
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_G))
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_G)), 0)
        it = 0
        t = 0
        for i_r in range(gl.program_id(0), s_q, gl.num_programs(0)):
            n_end = _sparse_mla_fewhead_row_keys(topk_len_ptr, i_r, topk, HAS_TOPK_LEN)
            p_idx = idx_ptr + i_r.to(gl.int64) * stride_idx_row
            for n0 in range(0, n_end, BLOCK_N):
                # issued before the slot waits below, so its latency hides behind them
                b_idx = gl.load(p_idx + n0 + o_n, mask=n0 + o_n < n_end, other=-1)
                m_n = (b_idx >= 0) & (b_idx < s_kv)
                # [BN, 64] addresses; invalid rows point at row 0 and are zero-filled
                p_2d = kv_ptr + gl.expand_dims(gl.where(m_n, b_idx, 0).to(gl.int64) * stride_kv, 1) + o_c
                m_2d = gl.expand_dims(m_n, 1) & (o_c < 64)
                for g in gl.static_range(4):
                    slot = it % SLOTS
                    # wait until the compute warpgroup released this slot (passes at once on first use)
                    mbarrier.wait(empty_bars.index(slot), ((it // SLOTS) & 1) ^ 1)
                    dst = k_ring.index(slot)
                    cp_async(dst.slice(0, 64, dim=1), p_2d + g * 128, mask=m_2d)
                    cp_async(dst.slice(64, 64, dim=1), p_2d + (g * 128 + 64), mask=m_2d)
                    if g == 3:
                        # the rope stage of tile t was last read by tile t - ROPE_STAGES, released
                        # before this slot (SLOTS <= 4 * ROPE_STAGES + 3)
                        cp_async(r_ring.index(t % ROPE_STAGES), p_2d + 512, mask=m_2d)
                    async_copy.mbarrier_arrive(full_bars.index(slot), increment_count=False)
                    it += 1
                t += 1

    @gluon.jit
    def _sparse_mla_fewhead_compute(
        zero, q_ptr, idx_ptr, topk_len_ptr, sink_ptr, out_ptr, lse_ptr, max_ptr,
        qk_scale, s_q, h_q, topk, s_kv,
        stride_q_row, stride_q_head, stride_idx_row, stride_o_row, stride_o_head, stride_l_row,
        k_ring, r_ring, q_smem, qr_smem, p_smem, full_bars, empty_bars,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr, ROPE_STAGES: gl.constexpr,
        HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        """Compute partition (one warpgroup): scores, softmax, ``P V`` and each row's outputs."""
        # S^T [BN, BH] and the O^T blocks [128, BH] share one MMA layout: keys / latent dims on M.
        # ``zero`` is 0 at run time (see the module docstring)
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_KEY: gl.constexpr = gl.SliceLayout(1, L_S)
        L_HEAD: gl.constexpr = gl.SliceLayout(0, L_S)
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        o_nk = gl.arange(0, BLOCK_N, layout=L_KEY)
        o_h = gl.arange(0, BLOCK_H, layout=L_HEAD)
        m_h = o_h < h_q
        o_hq = gl.minimum(gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q)), h_q - 1)
        o_qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q)), 0)
        o_qh = gl.expand_dims(o_hq.to(gl.int64) * stride_q_head, 1)
        if HAS_SINK:
            b_sink = gl.load(sink_ptr + o_h, mask=m_h, other=0.0)
        it = 0
        t = 0
        for i_r in range(gl.program_id(0), s_q, gl.num_programs(0)):
            i_r64 = i_r.to(gl.int64)
            n_end = _sparse_mla_fewhead_row_keys(topk_len_ptr, i_r, topk, HAS_TOPK_LEN)
            p_idx = idx_ptr + i_r64 * stride_idx_row
            b_idx = gl.load(p_idx + o_nk, mask=o_nk < n_end, other=-1)
            # ---- q -> shared memory (the previous row's MMAs are done); padded heads copy head h_q - 1:
            # their columns of S^T and O^T are never stored
            p_q = q_ptr + i_r64 * stride_q_row + o_qh
            for c in gl.static_range(8):
                cp_async(q_smem.index(c // 2).slice((c % 2) * 64, 64, dim=1), p_q + (c * 64 + o_qc))
            cp_async(qr_smem.index(0), p_q + (512 + o_qc))
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            cta_barrier()

            b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=L_HEAD)
            b_l = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
            b_acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_S)
            b_acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_S)
            b_acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_S)
            b_acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_S)
            for n0 in range(0, n_end, BLOCK_N):
                # zero at run time: the MMA descriptors of q and P are formed per tile (kept across the
                # loop they would take two registers each)
                z = n0 * zero
                m_n = (b_idx >= 0) & (b_idx < s_kv)
                n1 = n0 + BLOCK_N
                b_idx = gl.load(p_idx + n1 + o_nk, mask=n1 + o_nk < n_end, other=-1)
                s0 = it % SLOTS
                s1 = (it + 1) % SLOTS
                s2 = (it + 2) % SLOTS
                s3 = (it + 3) % SLOTS
                mbarrier.wait(full_bars.index(s0), (it // SLOTS) & 1)
                mbarrier.wait(full_bars.index(s1), ((it + 1) // SLOTS) & 1)
                mbarrier.wait(full_bars.index(s2), ((it + 2) // SLOTS) & 1)
                mbarrier.wait(full_bars.index(s3), ((it + 3) // SLOTS) & 1)
                fence_async_shared()
                k0 = k_ring.index(s0)
                k1 = k_ring.index(s1)
                k2 = k_ring.index(s2)
                k3 = k_ring.index(s3)
                # S^T [BN, BH]
                b_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
                b_s = warpgroup_mma(k0, q_smem.index(0 + z).permute((1, 0)), b_s, use_acc=False, is_async=True)
                b_s = warpgroup_mma(k1, q_smem.index(1 + z).permute((1, 0)), b_s, is_async=True)
                b_s = warpgroup_mma(k2, q_smem.index(2 + z).permute((1, 0)), b_s, is_async=True)
                b_s = warpgroup_mma(k3, q_smem.index(3 + z).permute((1, 0)), b_s, is_async=True)
                b_s = warpgroup_mma(r_ring.index(t % ROPE_STAGES), qr_smem.index(z).permute((1, 0)), b_s,
                                    is_async=True)
                b_s = warpgroup_mma_wait(0, deps=[b_s])

                b_s = gl.where(gl.expand_dims(m_n, 1), b_s * qk_scale, float("-inf"))
                b_m_new = gl.maximum(b_m, gl.max(b_s, axis=0))
                b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
                b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 0))
                b_alpha = gl.expand_dims(gl.exp2(b_m - b_m_use), 0)
                b_l = b_l * b_alpha + b_p
                b_m = b_m_new
                p_cur = p_smem.index(z)
                p_cur.store(b_p.to(gl.bfloat16))
                fence_async_shared()
                cta_barrier()
                # O^T [512, BH] += V^T P^T, V^T the permuted latent groups
                b_acc0 = warpgroup_mma(k0.permute((1, 0)), p_cur, b_acc0 * b_alpha, is_async=True)
                b_acc1 = warpgroup_mma(k1.permute((1, 0)), p_cur, b_acc1 * b_alpha, is_async=True)
                b_acc2 = warpgroup_mma(k2.permute((1, 0)), p_cur, b_acc2 * b_alpha, is_async=True)
                b_acc3 = warpgroup_mma(k3.permute((1, 0)), p_cur, b_acc3 * b_alpha, is_async=True)
                b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[b_acc0, b_acc1, b_acc2, b_acc3])
                # every warp is done with the tile (and with P): release its slots to the loader
                cta_barrier()
                mbarrier.arrive(empty_bars.index(s0))
                mbarrier.arrive(empty_bars.index(s1))
                mbarrier.arrive(empty_bars.index(s2))
                mbarrier.arrive(empty_bars.index(s3))
                it += 4
                t += 1

            # ---- epilogue of the row
            b_lsum = gl.sum(b_l, axis=0)
            m_empty = b_lsum == 0.0
            b_inv = 1.0 / gl.where(m_empty, 1.0, b_lsum)
            b_lse = gl.where(m_empty, float("inf"), (b_m + gl.log2(gl.where(m_empty, 1.0, b_lsum)))
                             * 0.6931471805599453)
            if HAS_SINK:
                # exp(lse) / (exp(lse) + exp(sink)); empty rows have out = 0 already
                b_inv = b_inv / (1.0 + gl.exp(b_sink - gl.where(m_empty, 0.0, b_lse)))
            o_l = i_r64 * stride_l_row + o_h
            gl.store(lse_ptr + o_l, b_lse, mask=m_h)
            gl.store(max_ptr + o_l, b_m * 0.6931471805599453, mask=m_h)
            b_inv2 = gl.expand_dims(b_inv, 0)
            m_o = gl.expand_dims(m_h, 0)
            p_o = (out_ptr + i_r64 * stride_o_row + gl.expand_dims(o_h.to(gl.int64) * stride_o_head, 0)
                   + gl.expand_dims(gl.arange(0, 128, layout=L_KEY), 1))
            gl.store(p_o, (b_acc0 * b_inv2).to(gl.bfloat16), mask=m_o)
            gl.store(p_o + 128, (b_acc1 * b_inv2).to(gl.bfloat16), mask=m_o)
            gl.store(p_o + 256, (b_acc2 * b_inv2).to(gl.bfloat16), mask=m_o)
            gl.store(p_o + 384, (b_acc3 * b_inv2).to(gl.bfloat16), mask=m_o)

    @gluon.jit(do_not_specialize=["zero"])
    def _sparse_mla_prefill_fewhead_kernel(
        zero, q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr, max_ptr,
        qk_scale,
        s_q, h_q, topk, s_kv,
        stride_q_row, stride_q_head, stride_idx_row, stride_kv,
        stride_o_row, stride_o_head, stride_l_row,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr, ROPE_STAGES: gl.constexpr,
        HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
        NUM_WARPS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        gl.static_assert(BLOCK_N == 64)
        gl.static_assert(SLOTS >= 4)
        gl.static_assert(SLOTS <= 4 * ROPE_STAGES + 3)
        K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.bfloat16)
        KR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
        QR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)
        k_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_N, 128], K_SL)
        r_ring = gl.allocate_shared_memory(gl.bfloat16, [ROPE_STAGES, BLOCK_N, 64], KR_SL)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, 64], QR_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, BLOCK_H], P_SL)
        full_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        # loader arrivals: one per loader thread when its copies land; release: one per tile
        for s in gl.static_range(SLOTS):
            mbarrier.init(full_bars.index(s), count=LOADER_WARPS * 32)
            mbarrier.init(empty_bars.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_sparse_mla_fewhead_compute, (
                zero, q_ptr, idx_ptr, topk_len_ptr, sink_ptr, out_ptr, lse_ptr, max_ptr,
                qk_scale, s_q, h_q, topk, s_kv,
                stride_q_row, stride_q_head, stride_idx_row, stride_o_row, stride_o_head, stride_l_row,
                k_ring, r_ring, q_smem, qr_smem, p_smem, full_bars, empty_bars,
                BLOCK_H, BLOCK_N, SLOTS, ROPE_STAGES, HAS_SINK, HAS_TOPK_LEN, NUM_WARPS)),
            (_sparse_mla_fewhead_loader, (
                kv_ptr, idx_ptr, topk_len_ptr, s_q, topk, s_kv, stride_idx_row, stride_kv,
                k_ring, r_ring, full_bars, empty_bars,
                BLOCK_N, SLOTS, ROPE_STAGES, HAS_TOPK_LEN, LOADER_WARPS)),
        ], [LOADER_WARPS], [LOADER_REGS])


def kernel():
    """The Gluon kernel; ``None`` when this Triton has no usable Gluon."""
    if gluon is None:
        return None
    return _sparse_mla_prefill_fewhead_kernel


def block_h_for(h_q: int) -> int:
    """Heads per program: 16 up to 16 heads, 32 above."""
    if not 1 <= h_q <= MAX_HEADS:
        raise ValueError(f"the few-head kernel takes 1..{MAX_HEADS} heads, got {h_q}")
    return 16 if h_q <= 16 else 32


@dataclass(frozen=True)
class FewheadPlan:
    """Launch plan of the few-head kernel.

    ``slots`` latent-group buffers and ``rope_stages`` rope buffers per program, ``programs`` programs
    (each walks every ``programs``-th query row), ``maxnreg`` registers per thread at launch (``None``:
    Triton's default), ``loader_warps`` warps in the loader partition with ``loader_regs`` registers per
    thread (the compute warpgroup gets the rest).
    """

    block_h: int
    slots: int
    rope_stages: int
    programs: int
    maxnreg: int | None
    loader_warps: int
    loader_regs: int


# Per head block: (slots, rope_stages, maxnreg, loader_warps, loader_regs); H200 sweeps in
# bench/results/h200/tuning/sparse_mla_prefill_fewhead.md. Two programs share an SM (one tile of keys
# each, and one group of the next with 16 heads) with 128 registers per thread at launch, so one
# program's MMAs run while the other waits for its gathers or computes its softmax. With 32 heads the
# loader keeps 24 registers per thread and leaves 232 to the 128 accumulators of the compute warpgroup.
PLANS: dict[int, tuple[int, int, int | None, int, int]] = {16: (5, 1, 128, 4, 40), 32: (4, 1, 128, 4, 24)}


def fewhead_plan(s_q: int, h_q: int, *, programs: int | None = None, slots: int | None = None,
                 rope_stages: int | None = None, maxnreg: int | None = 0,
                 loader_warps: int | None = None, loader_regs: int | None = None) -> FewheadPlan:
    """The launch plan for ``h_q`` heads (a function of the shapes only); the keywords override it
    (``maxnreg=None``: Triton's default register budget).

    By default one program per query row (``programs = s_q``): the hardware starts each program as
    soon as a previous one ends, which balances rows that gather at different speeds.
    """
    bh = block_h_for(h_q)
    d_slots, d_rope, d_maxnreg, d_lw, d_lr = PLANS[bh]
    ns = d_slots if slots is None else slots
    rs = d_rope if rope_stages is None else rope_stages
    lw = d_lw if loader_warps is None else loader_warps
    if rs not in (1, 2):
        raise ValueError(f"rope_stages must be 1 or 2, got {rs}")
    # the rope stage of a tile is rewritten once the tile rope_stages back released its slots
    if not 4 <= ns <= 4 * rs + 3:
        raise ValueError(f"slots must be in [4, {4 * rs + 3}] with {rs} rope stage(s), got {ns}")
    if lw not in (1, 2, 4):
        raise ValueError(f"loader_warps must be 1, 2 or 4, got {lw}")
    grid = s_q if programs is None else programs
    lr = d_lr if loader_regs is None else loader_regs
    if lr % 8 or not 24 <= lr <= 256:
        raise ValueError(f"loader_regs must be a multiple of 8 in [24, 256], got {lr}")
    return FewheadPlan(bh, ns, rs, max(1, min(grid, s_q)), d_maxnreg if maxnreg == 0 else maxnreg, lw, lr)


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int, arch: int | None) -> bool:
    """Whether the few-head kernel takes this call: ``ENABLED``, ``h_q <= 32``, the shapes and dtypes it
    covers, 16-byte aligned rows for ``cp.async``, a real sm_90 device and Gluon allowed
    (``nsa_backend.kernels._gluon``)."""
    return ENABLED and 1 <= q.shape[1] <= MAX_HEADS and rows_supported(q, kv, d_v, arch)


def flash_mla_sparse_fwd_gluon_fewhead(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    **plan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.flash_mla_sparse_fwd` for ``h_q <= 32`` (sm_90; see :func:`supported`).

    Same parameters and results as ``nsa_backend.kernels.sparse_mla_prefill.flash_mla_sparse_fwd_triton``;
    ``plan`` keywords override :func:`fewhead_plan`.
    """
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    p = fewhead_plan(s_q, h_q, **plan)
    kv2, idx = prefill_rows(kv, indices)
    launch = {"maxnreg": p.maxnreg} if p.maxnreg else {}
    kernel()[(p.programs,)](
        0, q, kv2, idx,
        attn_sink if attn_sink is not None else lse,
        topk_length if topk_length is not None else idx,
        out, lse, max_logits,
        sm_scale * LOG2E,
        s_q, h_q, topk, s_kv,
        q.stride(0), q.stride(1), idx.stride(0), kv2.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        **_constexprs(p, attn_sink is not None, topk_length is not None),
        num_warps=NUM_WARPS, **launch,
    )
    return out, max_logits, lse


def _constexprs(p: FewheadPlan, has_sink: bool, has_topk_len: bool) -> dict:
    return dict(BLOCK_H=p.block_h, BLOCK_N=BLOCK_N, SLOTS=p.slots, ROPE_STAGES=p.rope_stages, HAS_SINK=has_sink,
                HAS_TOPK_LEN=has_topk_len, NUM_WARPS=NUM_WARPS, LOADER_WARPS=p.loader_warps,
                LOADER_REGS=p.loader_regs)


def compile_for_sm90(h_q: int = 16, arch: int = 90, **plan):
    """Compile the kernel ahead of time for ``sm_<arch>`` (no GPU needed) with the plan of ``h_q`` heads
    (``plan`` keywords override it) and the runtime's argument specialisation (16-byte aligned pointers
    and strides); returns Triton's compiled kernel, whose ``metadata.shared`` is the shared memory per
    program in bytes. Requires Gluon (``gluon_importable``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    p = fewhead_plan(1, h_q, **plan)
    fn = kernel()
    names = fn.arg_names
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
            "topk_len_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "max_ptr": "*fp32"}
    consts = _constexprs(p, True, True)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n == "qk_scale" else "i32"))
           for n in names}
    aligned = [n for n in names if n in ptrs or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    options = {"num_warps": NUM_WARPS, **({"maxnreg": p.maxnreg} if p.maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


__all__ = [
    "GLUON_ARCHS", "PLANS", "FewheadPlan", "compile_for_sm90", "fewhead_plan", "flash_mla_sparse_fwd_gluon_fewhead",
    "kernel", "supported",
]
