"""Gluon mHC pre-norm GEMM for sm_90 (Hopper): ``a`` streamed by TMA, one launch per call.

:func:`tf32_hc_prenorm_gemm_gluon` computes :func:`nsa_backend.tf32_hc_prenorm_gemm` (``d = a @ b.T``,
``sqr_sum = sum(a^2, -1)``, any ``num_splits``) for ``N <= 32``. The launcher
``nsa_backend.kernels.mhc.tf32_hc_prenorm_gemm_triton`` calls it where :func:`supported` says so
(``configs.mhc.GLUON_ENABLED`` and ``GLUON_ROUTES``; off by default: slower than the ``tl`` path on
the H200 at every measured M, see ``bench/results/h200/tuning/mhc.parts.md``).

Program ``(o_t, c)`` computes chunk ``c`` of ``C`` of output tile ``o_t`` (split ``o_t // tiles``, row
tile ``o_t % tiles`` of ``BLOCK_M`` rows): the split's column blocks of 64 ``c, c + C, c + 2C, ...``,
so the chunks of a row tile read neighbouring columns of the same rows at the same time. ``C`` fills
the GPU (``_plan``). With ``C = 1`` the program writes ``d`` and ``sqr_sum``; otherwise it writes its
partial sums to an fp32 workspace and counts its arrival on the tile's counter, and the chunk that
arrives last adds the ``C`` partial sums in chunk order (deterministic whichever chunk that is),
writes the tile and sets the counter back to zero, so the counters are zero between calls and the
launch can be captured in a CUDA graph (the counters are per device and stream: calls on one
stream never overlap).

Inside a program a one-warp loader partition streams, per column block, the ``[BLOCK_M, 64]`` tile of
``a`` (TMA; rows past ``M`` and columns past ``K`` zero-filled) into a ring of ``STAGES`` buffers
(``full`` / ``empty`` mbarriers), with ``b`` in one of two forms (``configs.mhc.GluonConfig.presplit``):

- the ``[32, 64]`` fp32 slice of ``b`` (TMA, rows past ``N`` zero-filled): the compute warps split it
  into its bf16 parts ``hi + lo`` (16 significant bits, as the ``tl`` path's ``PARTS_PRECISION =
  "bf16x2"``), stacked as ``[64, 64]`` in shared memory, the next block's parts while the current
  block's product runs;
- ``presplit``: the stacked parts made once per call by a small ``tl`` kernel (``[64, K]`` bf16, rows
  past ``N`` of each part zero) and streamed with ``a``; the launch uses programmatic dependent
  launch (``pdl``): the loader requests the first stages' ``a`` tiles, then waits for the split
  kernel before requesting the parts.

The compute partition (one or two warpgroups) multiplies each ``a`` tile with the stacked parts in
one asynchronous warpgroup MMA (``[BLOCK_M, 64]`` fp32: columns ``n`` and ``32 + n`` are the products
with ``hi`` and ``lo``, added in the epilogue), adds the squares of the same tile read from shared
memory meanwhile, then releases the buffer.

Only sm_90 with Triton's Gluon dialect (see ``nsa_backend.kernels._gluon``) runs this kernel.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable

# Capabilities the kernel is written for (TMA, warpgroup MMA).
GLUON_ARCHS: tuple[int, ...] = (90,)
BLOCK_K = 64
BLOCK_N = 32

@triton.jit
def _mhc_gluon_split_b_kernel(b_ptr, bp_ptr, N, K, ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # b: [N, K] fp32 -> bp: [2 * ROWS, K] bf16, rows [0, ROWS) the parts hi, rows [ROWS, 2 * ROWS) lo with
    # b ~ hi + lo (16 significant bits); rows past N zero. USE_PDL: the kernel launched after this one
    # (programmatic dependent launch) may start now and waits for this one before reading bp.
    if USE_PDL:
        gdc_launch_dependents()
    i_b = tl.program_id(0)
    o = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over [ROWS, K]
    m = o < ROWS * K
    b_b = tl.load(b_ptr + o, mask=m & (o < N * K), other=0.0)
    b_hi = b_b.to(tl.bfloat16)
    b_lo = (b_b - b_hi.to(tl.float32)).to(tl.bfloat16)
    tl.store(bp_ptr + o, b_hi, mask=m)
    tl.store(bp_ptr + ROWS * K + o, b_lo, mask=m)


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

    from nsa_backend.kernels._gluon import cta_barrier, tma_load
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


if gluon is not None:

    @gluon.jit
    def _mhc_gluon_fixup(ws_ptr, d_ptr, sq_ptr, M, N, i_t, slot0, C,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
                         FIX_UNROLL: gl.constexpr):
        """Sum of the ``C`` partial sums of row tile ``i_t`` (workspace slots ``slot0 .. slot0 + C - 1``) in
        slot order, ``FIX_UNROLL`` slots read at once, written to ``d`` and ``sqr_sum``."""
        L_F: gl.constexpr = gl.BlockedLayout([4], [32], [NUM_WARPS], [0])
        L_Q: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        WS_L: gl.constexpr = BLOCK_M * BLOCK_N + BLOCK_M
        o_f = gl.arange(0, BLOCK_M * BLOCK_N, layout=L_F)
        m_f = o_f < BLOCK_M * N
        o_q = gl.arange(0, BLOCK_M, layout=L_Q)
        b_d = gl.zeros([BLOCK_M * BLOCK_N], gl.float32, layout=L_F)
        b_q = gl.zeros([BLOCK_M], gl.float32, layout=L_Q)
        gl.static_assert((FIX_UNROLL == 1) | (FIX_UNROLL == 2) | (FIX_UNROLL == 4))
        for c0 in range(0, C, FIX_UNROLL):
            p_w = ws_ptr + (slot0 + c0).to(gl.int64) * WS_L
            x_d0 = gl.load(p_w + o_f, mask=m_f, other=0.0, cache_modifier=".cg")
            x_q0 = gl.load(p_w + BLOCK_M * BLOCK_N + o_q, cache_modifier=".cg")
            if FIX_UNROLL >= 2:
                m_1 = c0 + 1 < C
                x_d1 = gl.load(p_w + WS_L + o_f, mask=m_f & m_1, other=0.0, cache_modifier=".cg")
                x_q1 = gl.load(p_w + WS_L + BLOCK_M * BLOCK_N + o_q, mask=(o_q >= 0) & m_1, other=0.0,
                               cache_modifier=".cg")
            if FIX_UNROLL == 4:
                m_2 = c0 + 2 < C
                m_3 = c0 + 3 < C
                x_d2 = gl.load(p_w + 2 * WS_L + o_f, mask=m_f & m_2, other=0.0, cache_modifier=".cg")
                x_q2 = gl.load(p_w + 2 * WS_L + BLOCK_M * BLOCK_N + o_q, mask=(o_q >= 0) & m_2, other=0.0,
                               cache_modifier=".cg")
                x_d3 = gl.load(p_w + 3 * WS_L + o_f, mask=m_f & m_3, other=0.0, cache_modifier=".cg")
                x_q3 = gl.load(p_w + 3 * WS_L + BLOCK_M * BLOCK_N + o_q, mask=(o_q >= 0) & m_3, other=0.0,
                               cache_modifier=".cg")
            b_d += x_d0
            b_q += x_q0
            if FIX_UNROLL >= 2:
                b_d += x_d1
                b_q += x_q1
            if FIX_UNROLL == 4:
                b_d += x_d2
                b_q += x_q2
                b_d += x_d3
                b_q += x_q3
        # the tile's rows of d are contiguous: [BLOCK_M, N] at row i_t * BLOCK_M
        o_d = i_t.to(gl.int64) * BLOCK_M * N + o_f
        gl.store(d_ptr + o_d, b_d, mask=m_f & (o_d < M.to(gl.int64) * N))
        o_qm = i_t * BLOCK_M + o_q
        gl.store(sq_ptr + o_qm, b_q, mask=o_qm < M)

    @gluon.jit
    def _mhc_gluon_gdc_wait():
        """Wait until the kernel this one depends on (programmatic dependent launch) has completed."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _mhc_gluon_loader(a_desc, b_desc, a_smem, b_smem, full_bars, empty_bars, i_t, kb0, n_units, C,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                          PRESPLIT: gl.constexpr, PDL: gl.constexpr):
        """Loader partition (one warp): per unit ``j`` (column block ``kb0 + j * C``) the ``[BLOCK_M,
        BLOCK_K]`` tile of ``a`` and the ``[BLOCK_N, BLOCK_K]`` fp32 slice of ``b`` into the ring stage the
        compute warps released (rows past ``M`` or ``N`` and columns past ``K`` are zero-filled by the TMA
        unit)."""
        if PRESPLIT:
            # the stacked parts [2 * BLOCK_N, BLOCK_K] bf16 of b from the split kernel; the first stages'
            # a tiles are requested before waiting for that kernel
            P_BYTES: gl.constexpr = BLOCK_M * BLOCK_K * 2 + 2 * BLOCK_N * BLOCK_K * 2
            n_pre = gl.minimum(n_units, STAGES)
            for j in range(n_pre):
                mbarrier.expect(full_bars.index(j), P_BYTES)
                tma_load(a_desc, [i_t * BLOCK_M, (kb0 + j * C) * BLOCK_K], full_bars.index(j), a_smem.index(j))
            if PDL:
                _mhc_gluon_gdc_wait()
            for j in range(n_pre):
                tma_load(b_desc, [0, (kb0 + j * C) * BLOCK_K], full_bars.index(j), b_smem.index(j))
            for j in range(n_pre, n_units):
                st = j % STAGES
                k0 = (kb0 + j * C) * BLOCK_K
                mbarrier.wait(empty_bars.index(st), ((j // STAGES) & 1) ^ 1)
                bar = full_bars.index(st)
                mbarrier.expect(bar, P_BYTES)
                tma_load(b_desc, [0, k0], bar, b_smem.index(st))
                tma_load(a_desc, [i_t * BLOCK_M, k0], bar, a_smem.index(st))
        else:
            for j in range(n_units):
                st = j % STAGES
                k0 = (kb0 + j * C) * BLOCK_K
                # passes at once on the buffer's first use
                mbarrier.wait(empty_bars.index(st), ((j // STAGES) & 1) ^ 1)
                bar = full_bars.index(st)
                mbarrier.expect(bar, BLOCK_M * BLOCK_K * 2 + BLOCK_N * BLOCK_K * 4)
                tma_load(b_desc, [0, k0], bar, b_smem.index(st))
                tma_load(a_desc, [i_t * BLOCK_M, k0], bar, a_smem.index(st))

    @gluon.jit
    def _mhc_gluon_parts(b_smem, p_smem, st, pb, L_B: gl.constexpr, BLOCK_N: gl.constexpr):
        """Split the fp32 ``b`` slice of ring stage ``st`` into its bf16 parts ``hi + lo`` (16 significant
        bits), stacked in parts buffer ``pb``: ``hi`` in rows ``[0, BLOCK_N)``, ``lo`` in the next."""
        b_b = b_smem.index(st).load(L_B)
        b_hi = b_b.to(gl.bfloat16)
        b_lo = (b_b - b_hi.to(gl.float32)).to(gl.bfloat16)
        p_smem.index(pb).slice(0, BLOCK_N).store(b_hi)
        p_smem.index(pb).slice(BLOCK_N, BLOCK_N).store(b_lo)
        fence_async_shared()

    @gluon.jit
    def _mhc_gluon_consumer(d_ptr, sq_ptr, ws_ptr, cnt_ptr, M, N, i_s, i_t, o_t, c, C, n_units,
                            a_smem, b_smem, p_smem, full_bars, empty_bars,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, FIX_UNROLL: gl.constexpr,
                            SQ_WR: gl.constexpr, SQ_WC: gl.constexpr, PRESPLIT: gl.constexpr):
        """Compute partition (``NUM_WARPS`` warps: one or two warpgroups, each with 64-row blocks of the
        MMA). Per unit: the MMAs of its ``a`` tile with the parts of ``b`` (asynchronous), the square
        sums of the same tile and the parts of the next unit's ``b`` while they run. Then the chunk's
        sums: written to ``d`` (one chunk) or to the workspace, the last chunk of the row tile adding
        them all (see the module docstring)."""
        # the product with both parts at once: [BLOCK_M, 2 * BLOCK_N], hi columns then lo columns
        L_ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, 2 * BLOCK_N, 16])
        L_O: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])
        # square sums: a row of the a tile over SQ_WC threads (of SQ_WC warps); with SQ_WC > 1 they are
        # kept per column until the chunk ends (no exchange between warps per unit)
        L_SQ: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // SQ_WC], [32, 1], [SQ_WR, SQ_WC], [1, 0])
        L_B: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [NUM_WARPS, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, L_O)
        COL: gl.constexpr = gl.SliceLayout(0, L_O)
        SQ_ROW: gl.constexpr = gl.SliceLayout(1, L_SQ)
        WS_L: gl.constexpr = BLOCK_M * BLOCK_N + BLOCK_M  # one workspace slot: d tile, then sqr_sum

        acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, layout=L_ACC)
        if SQ_WC > 1:
            b_sq2 = gl.zeros([BLOCK_M, BLOCK_K], gl.float32, layout=L_SQ)
        else:
            b_sq = gl.zeros([BLOCK_M], gl.float32, layout=SQ_ROW)
        if PRESPLIT:
            # the parts of b come with each a tile
            for j in range(n_units):
                st = j % STAGES
                mbarrier.wait(full_bars.index(st), (j // STAGES) & 1)
                t_acc = warpgroup_mma(a_smem.index(st), b_smem.index(st).permute((1, 0)), acc, is_async=True)
                b_a = a_smem.index(st).load(L_SQ).to(gl.float32)  # [BLOCK_M, BLOCK_K]
                if SQ_WC > 1:
                    b_sq2 += b_a * b_a
                else:
                    b_sq += gl.sum(b_a * b_a, axis=1)
                acc = warpgroup_mma_wait(0, deps=[t_acc])
                async_copy.mbarrier_arrive(empty_bars.index(st), increment_count=False)
        else:
            # the first unit's parts of b
            if n_units > 0:
                mbarrier.wait(full_bars.index(0), 0)
                _mhc_gluon_parts(b_smem, p_smem, 0, 0, L_B, BLOCK_N)
            cta_barrier()
            for j in range(n_units):
                # invariant: unit j's stage has landed and its parts of b are in parts buffer j % 2
                st = j % STAGES
                pb = j % 2
                t_acc = warpgroup_mma(a_smem.index(st), p_smem.index(pb).permute((1, 0)), acc, is_async=True)
                b_a = a_smem.index(st).load(L_SQ).to(gl.float32)  # [BLOCK_M, BLOCK_K]
                if SQ_WC > 1:
                    b_sq2 += b_a * b_a
                else:
                    b_sq += gl.sum(b_a * b_a, axis=1)
                if j + 1 < n_units:
                    # the next unit's parts (the other parts buffer: the MMAs that read it have completed)
                    st_n = (j + 1) % STAGES
                    mbarrier.wait(full_bars.index(st_n), ((j + 1) // STAGES) & 1)
                    _mhc_gluon_parts(b_smem, p_smem, st_n, 1 - pb, L_B, BLOCK_N)
                acc = warpgroup_mma_wait(0, deps=[t_acc])
                async_copy.mbarrier_arrive(empty_bars.index(st), increment_count=False)
                # the next unit's parts are visible to every warp's MMA
                cta_barrier()
        if SQ_WC > 1:
            b_sq = gl.sum(b_sq2, axis=1)
        # d = a (hi + lo)^T: the two column halves (the same thread holds column n of both)
        b_hi, b_lo = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        b_d = gl.convert_layout(b_hi + b_lo, L_O)

        o_r = gl.arange(0, BLOCK_M, layout=ROW)
        o_c = gl.arange(0, BLOCK_N, layout=COL)
        o_sr = gl.arange(0, BLOCK_M, layout=SQ_ROW)
        d_s = d_ptr + i_s.to(gl.int64) * M * N
        sq_s = sq_ptr + i_s.to(gl.int64) * M
        if C == 1:
            o_m = i_t * BLOCK_M + o_r
            o_sm = i_t * BLOCK_M + o_sr
            m_d = gl.expand_dims(o_m < M, 1) & gl.expand_dims(o_c < N, 0)
            p_d = d_s + gl.expand_dims(o_m.to(gl.int64) * N, 1) + gl.expand_dims(o_c, 0)
            gl.store(p_d, b_d, mask=m_d)
            gl.store(sq_s + o_sm, b_sq, mask=o_sm < M)
        else:
            # slot o_t * C + c: the chunk's partial sums ([BLOCK_M, N] then [BLOCK_M])
            p_ws = ws_ptr + (o_t * C + c).to(gl.int64) * WS_L
            o_ws = gl.expand_dims(o_r * N, 1) + gl.expand_dims(o_c, 0)
            gl.store(p_ws + o_ws, b_d, mask=gl.expand_dims(o_c < N, 0))
            gl.store(p_ws + BLOCK_M * BLOCK_N + o_sr, b_sq)
            cta_barrier()
            arrived = gl.atomic_add(cnt_ptr + o_t, 1, sem="acq_rel", scope="gpu")
            if arrived == C - 1:
                # last chunk of the row tile: add the C partial sums in chunk order
                _mhc_gluon_fixup(ws_ptr, d_s, sq_s, M, N, i_t, o_t * C, C, BLOCK_M, BLOCK_N, NUM_WARPS,
                                 FIX_UNROLL)
                gl.store(cnt_ptr + o_t, 0)

    # M and the row tiles may be 1 (never specialised to a constant)
    @gluon.jit(do_not_specialize=["M", "KBS", "tiles", "C"])
    def _mhc_gluon_kernel(
        a_desc, b_desc, d_ptr, sq_ptr, ws_ptr, cnt_ptr, M, N, KBS, tiles, C,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, FIX_UNROLL: gl.constexpr, SQ_WR: gl.constexpr,
        SQ_WC: gl.constexpr, PRESPLIT: gl.constexpr, PDL: gl.constexpr,
    ):
        """Program ``(o_t, c)``: chunk ``c`` of ``C`` of output tile ``o_t`` (split ``o_t // tiles``, row
        tile ``o_t % tiles``), the split's column blocks ``c, c + C, ...`` (see the module docstring)."""
        P_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        o_t = gl.program_id(0)
        c = gl.program_id(1)
        i_s = o_t // tiles
        i_t = o_t % tiles
        n_units = gl.maximum(KBS - c + C - 1, 0) // C

        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        if PRESPLIT:
            # the stacked parts of b, one per stage (TMA)
            b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * BLOCK_N, BLOCK_K], b_desc.layout)
            p_smem = b_smem  # not used
        else:
            b_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BLOCK_N, BLOCK_K], P_SL)
        full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=NUM_WARPS * 32)
        fence_async_shared()

        gl.warp_specialize([
            (_mhc_gluon_consumer, (d_ptr, sq_ptr, ws_ptr, cnt_ptr, M, N, i_s, i_t, o_t, c, C, n_units,
                                   a_smem, b_smem, p_smem, full_bars, empty_bars,
                                   BLOCK_M, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS, FIX_UNROLL, SQ_WR, SQ_WC,
                                   PRESPLIT)),
            (_mhc_gluon_loader, (a_desc, b_desc, a_smem, b_smem, full_bars, empty_bars, i_t, i_s * KBS + c,
                                 n_units, C, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PRESPLIT, PDL)),
        ], [1], [LOADER_REGS])


def kernel():
    """The Gluon kernel; ``None`` when this Triton has no usable Gluon."""
    return _mhc_gluon_kernel if gluon_importable() else None


def shape_supported(a: torch.Tensor, b: torch.Tensor, num_splits: int | None) -> bool:
    """The calls the kernel computes: ``N <= 32``, ``K > 0``, 16-byte aligned ``a`` and ``b`` (TMA and
    vector loads) and ``M`` within the TMA coordinate range (``num_splits`` any)."""
    M, K = a.shape
    N = b.shape[0]
    return (N <= BLOCK_N and K > 0 and K % BLOCK_K == 0 and M < 2**31 - 256
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)


def supported(a: torch.Tensor, b: torch.Tensor, num_splits: int | None, arch: int | None) -> bool:
    """Whether the launcher takes the Gluon kernel for this call: routed by ``configs.mhc``
    (:func:`nsa_backend.configs.mhc.gluon_route`), :func:`shape_supported`, a real sm_90 device and
    Gluon allowed (``nsa_backend.kernels._gluon``)."""
    return (
        a.is_cuda
        and cfgs.gluon_route(a.shape[0], b.shape[0], arch) is not None
        and shape_supported(a, b, num_splits)
        and gluon_enabled(arch, GLUON_ARCHS)
    )


# Arrival counters per (device, stream): zero between calls (the last chunk of a row tile resets its
# counter), so calls that share one buffer must not overlap, which stream order guarantees.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_COUNTERS_LOCK = threading.Lock()


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters (at least ``tiles``) of the current stream of ``device``.

    Under CUDA-graph capture a buffer that is not cached yet (or too small) is allocated for the
    graph alone (its zeroing is part of the graph) and not cached."""
    stream = torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream.stream_id)
    with _COUNTERS_LOCK:
        buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    size = max(tiles, 1024, 0 if buf is None else 2 * buf.numel())
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    if not torch.cuda.is_current_stream_capturing():
        with _COUNTERS_LOCK:
            _COUNTERS[key] = buf
    return buf


@functools.lru_cache(maxsize=256)
def _plan(M: int, K: int, splits: int, block_m: int, slots: int) -> tuple[int, int, int]:
    """``(kbs, tiles, chunks)`` of a launch: column blocks of ``BLOCK_K`` per split (the partition of
    ``nsa_backend.reference.split_bounds``; the last splits may hold fewer or none of them), row tiles
    and chunks per output tile, as many as fill ``slots`` programs (at least one, at most a block
    each)."""
    kbs = triton.cdiv(K // BLOCK_K, splits)
    tiles = triton.cdiv(M, block_m)
    return kbs, tiles, max(1, min(kbs, slots // (splits * tiles)))


def _constexprs(cfg: cfgs.GluonConfig) -> dict:
    """Compile-time arguments of a launch: the tile, ring and the warps that share a row of the square
    sums (``SQ_WC``; ``SQ_WR`` warps of 32 rows cover the tile's rows)."""
    wr = max(1, min(cfg.num_warps, cfg.block_m // 32))
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=cfg.num_stages,
                NUM_WARPS=cfg.num_warps, LOADER_REGS=cfg.loader_regs, FIX_UNROLL=cfg.fix_unroll, SQ_WR=wr,
                SQ_WC=cfg.num_warps // wr, PRESPLIT=cfg.presplit, PDL=cfg.presplit and cfg.pdl)


@functools.cache
def _b_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


# Values per program of the split kernel.
SPLIT_BLOCK = 4096


@functools.cache
def _a_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def tf32_hc_prenorm_gemm_gluon(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
    *,
    config: cfgs.GluonConfig | None = None,
    programs: int | None = None,
) -> None:
    """Gluon :func:`nsa_backend.tf32_hc_prenorm_gemm` (sm_90, ``N <= 32``; see :func:`supported`); same
    parameters as ``tf32_hc_prenorm_gemm_triton``. ``config`` and ``programs`` (default:
    ``config.programs_per_sm`` per SM) override the route of ``configs.mhc``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from nsa_backend.kernels._arch import device_sms

    M, K = a.shape
    N = b.shape[0]
    if not shape_supported(a, b, num_splits):
        raise ValueError(f"the Gluon mHC kernel takes N <= {BLOCK_N} and 16-byte aligned a and b, got N {N}")
    if M == 0:
        return
    splits = 1 if num_splits is None else num_splits
    cfg = config or cfgs.gluon_route(M, N, 90) or cfgs.GLUON_ROUTES[-1][1]
    kbs, tiles, chunks = _plan(M, K, splits, cfg.block_m, programs or cfg.programs_per_sm * device_sms(a.device))
    slots = splits * tiles * chunks if chunks > 1 else 1
    ws = torch.empty((slots, cfg.block_m * BLOCK_N + cfg.block_m), dtype=torch.float32, device=a.device)
    cnt = _counters(a.device, splits * tiles)
    a_desc = TensorDescriptor(a, [M, K], [K, 1], [cfg.block_m, BLOCK_K], _a_layout())
    pdl = cfg.presplit and cfg.pdl
    if cfg.presplit:
        parts = torch.empty((2 * BLOCK_N, K), dtype=torch.bfloat16, device=a.device)
        _mhc_gluon_split_b_kernel[(triton.cdiv(BLOCK_N * K, SPLIT_BLOCK),)](
            b, parts, N, K, ROWS=BLOCK_N, BLOCK=SPLIT_BLOCK, USE_PDL=pdl, num_warps=4)
        b_desc = TensorDescriptor(parts, [2 * BLOCK_N, K], [K, 1], [2 * BLOCK_N, BLOCK_K], _a_layout())
    else:
        b_desc = TensorDescriptor(b, [N, K], [K, 1], [BLOCK_N, BLOCK_K], _b_layout())
    _mhc_gluon_kernel[(splits * tiles, chunks)](
        a_desc, b_desc, d, sqr_sum, ws, cnt, M, N, kbs, tiles, chunks, **_constexprs(cfg), num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )


def compile_for_sm90(config: cfgs.GluonConfig | None = None, arch: int = 90):
    """Compile the kernel of ``config`` (default: the last route of ``configs.mhc.GLUON_ROUTES``) ahead
    of time for ``sm_<arch>`` (no GPU needed) with the runtime's argument specialisation (16-byte
    aligned pointers). Returns Triton's compiled kernel (``metadata.shared``: shared memory per program
    in bytes). Requires Gluon (``gluon_importable``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    cfg = config or cfgs.GLUON_ROUTES[-1][1]
    fn = _mhc_gluon_kernel
    names = fn.arg_names
    ptrs = {"d_ptr": "*fp32", "sq_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    consts = _constexprs(cfg)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
    sig["a_desc"] = mangle_type(TensorDescriptor(torch.zeros(256, 256, dtype=torch.bfloat16), [256, 256], [256, 1],
                                                 [cfg.block_m, BLOCK_K], _a_layout()))
    if cfg.presplit:
        sig["b_desc"] = mangle_type(TensorDescriptor(torch.zeros(64, 256, dtype=torch.bfloat16), [64, 256], [256, 1],
                                                     [2 * BLOCK_N, BLOCK_K], _a_layout()))
    else:
        sig["b_desc"] = mangle_type(TensorDescriptor(torch.zeros(32, 256), [32, 256], [256, 1], [BLOCK_N, BLOCK_K],
                                                     _b_layout()))
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.num_warps})


__all__ = ["GLUON_ARCHS", "compile_for_sm90", "kernel", "shape_supported", "supported",
           "tf32_hc_prenorm_gemm_gluon"]
