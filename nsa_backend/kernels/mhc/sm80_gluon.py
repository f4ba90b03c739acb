"""Gluon stacked-parts mHC pre-norm GEMM for the mma.sync archs (sm_80 / 86 / 89 / 120 / 121).

The ``tl`` stacked-parts kernel (:mod:`.portable`) reads its pipelined ``a`` tile twice, once for the
tensor-core product and once for the square sums, and Triton then leaves that shared-memory buffer
unswizzled: its ``ldmatrix`` reads conflict in the banks and the tile cannot grow past 32 columns per
step without the loop slowing down. Here the layouts are chosen by hand:

- ``a`` ``[BLOCK_M, BLOCK_K]`` and the stacked parts of ``b`` ``[2 * BLOCK_N, BLOCK_K]`` (``bf16x2``:
  ``hi`` rows, then ``lo`` rows) are copied by ``cp.async`` into swizzled buffers, ``NUM_STAGES`` deep;
- each step loads ``a`` once into the registers of the MMA operand and takes the square sums from those
  same registers, so shared memory has a single reader per tile;
- the products with ``hi`` and ``lo`` accumulate separately (``mma_v2``) and are added after the loop,
  as the ``tl`` kernel adds its stacked parts.

Grid, K plan and outputs are those of the ``tl`` kernel (``nsa_backend.kernels.mhc.split_plan``): one
program per ``(M tile, split, chunk)``; partial sums stored per chunk slot, or added into the split's
slot with fp32 atomics (``ATOMIC_SUMS``, the outputs zeroed by the split kernel). ``K``, the split and
the chunk widths must be multiples of ``BLOCK_K`` (the launcher routes here only then).

The Gluon dialect is compiled, never interpreted: the CPU tests compile it ahead of time, the GPU tests
run it against the reference.
"""

from __future__ import annotations

from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


def usable(arch: int | None, block_n: int, precision: str, k: int, split_k: int, chunk_k: int,
           block_k: int) -> bool:
    """Whether this kernel may run a stacked-parts launch: an arch of ``GLUON_PARTS_ARCHS`` with Gluon on,
    the 32-wide N tile, two parts of ``b`` and every K range a whole number of ``block_k`` steps."""
    return (block_n == cfgs.PARTS_BLOCK_N and precision == "bf16x2"
            and k % block_k == 0 and split_k % block_k == 0 and chunk_k % block_k == 0
            and gluon_enabled(arch, cfgs.GLUON_PARTS_ARCHS))


if gluon is not None:

    @gluon.jit
    def _mhc_gluon_copy_step(a_ptr, bp_ptr, a_dst, b_dst, o_a, m_a, o_b, m_b, o_k, k, live):
        """Start the copies of step ``k`` (``a`` and the stacked parts; ``live`` False zero-fills) as one
        ``cp.async`` group."""
        k_ok = gl.expand_dims(o_k >= 0, 0)
        cp_async(a_dst, a_ptr + gl.expand_dims(o_a, 1) + gl.expand_dims(o_k + k, 0),
                 mask=gl.expand_dims(m_a & live, 1) & k_ok)
        cp_async(b_dst, bp_ptr + gl.expand_dims(o_b, 1) + gl.expand_dims(o_k + k, 0),
                 mask=gl.expand_dims(m_b & live, 1) & k_ok)
        async_copy.commit_group()

    @gluon.jit
    def _mhc_prenorm_gemm_gluon_kernel(
        a_ptr,
        bp_ptr,
        d_ptr,
        sq_ptr,
        M,
        N,
        K,
        SPLIT_K,
        CHUNK_K,
        NUM_CHUNKS,
        stride_dt,
        stride_st,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        ATOMIC_SUMS: gl.constexpr,
    ):
        # a: [M, K] bf16; bp: [2, N, K] bf16 (hi, lo); d: slot i at d_ptr + i * stride_dt, [M, N] fp32;
        # sq: slot i at sq_ptr + i * stride_st, [M] fp32 (slot = split with ATOMIC_SUMS, else split * chunks
        # + chunk). Warps side by side along M: each holds 16 rows of the product and reads the whole b tile.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, 8])
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # cp.async: 16 bytes (8 bf16) per thread, a row of the tile read by BLOCK_K // 8 threads.
        THREADS_K: gl.constexpr = BLOCK_K // 8
        L_CP: gl.constexpr = gl.BlockedLayout([1, 8], [32 // THREADS_K, THREADS_K], [NUM_WARPS, 1], [1, 0])
        # 16-byte vectors swizzled over the 128-byte phases: ldmatrix of 8 rows touches 8 bank groups.
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=max(1, 128 // (2 * BLOCK_K)),
                                                     max_phase=min(8, BLOCK_K // 8), order=[1, 0])
        L_SQ: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 4], [8, 4], [NUM_WARPS, 1], [1, 0])

        i_m, i_t = gl.program_id(0), gl.program_id(1)
        i_s = i_t // NUM_CHUNKS
        i_c = i_t % NUM_CHUNKS
        k_lo = i_s * SPLIT_K + i_c * CHUNK_K
        k_hi = gl.minimum(gl.minimum(i_s * SPLIT_K + SPLIT_K, K), k_lo + CHUNK_K)
        n_steps = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BLOCK_K)

        o_am = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_CP))
        o_r = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(1, L_CP))  # row r = part * BLOCK_N + n
        o_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, L_CP))
        o_a = o_am.to(gl.int64) * K
        o_b = ((o_r // BLOCK_N) * N + o_r % BLOCK_N).to(gl.int64) * K
        m_a = o_am < M
        m_b = (o_r % BLOCK_N) < N

        a_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_M, BLOCK_K], SMEM)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 2 * BLOCK_N, BLOCK_K], SMEM)
        for p in gl.static_range(NUM_STAGES - 1):
            _mhc_gluon_copy_step(a_ptr, bp_ptr, a_smem.index(p), b_smem.index(p), o_a, m_a, o_b, m_b, o_k,
                                 k_lo + p * BLOCK_K, p < n_steps)

        b_hi_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)
        b_lo_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)
        b_sq2 = gl.zeros([BLOCK_M, BLOCK_K], gl.float32, layout=OP_A)
        for i in range(n_steps):
            # Step i has landed for every thread, and every thread is done with the buffer refilled next.
            async_copy.wait_group(NUM_STAGES - 2)
            cta_barrier()
            j = i + NUM_STAGES - 1
            _mhc_gluon_copy_step(a_ptr, bp_ptr, a_smem.index(j % NUM_STAGES), b_smem.index(j % NUM_STAGES), o_a,
                                 m_a, o_b, m_b, o_k, k_lo + j * BLOCK_K, j < n_steps)
            b_a = a_smem.index(i % NUM_STAGES).load(OP_A)  # [BLOCK_M, BLOCK_K]
            b_parts = b_smem.index(i % NUM_STAGES)
            # one part's operand live at a time: [BLOCK_K, BLOCK_N] each
            b_hi_acc = mma_v2(b_a, b_parts.slice(0, BLOCK_N, dim=0).permute((1, 0)).load(OP_B), b_hi_acc)
            b_lo_acc = mma_v2(b_a, b_parts.slice(BLOCK_N, BLOCK_N, dim=0).permute((1, 0)).load(OP_B), b_lo_acc)
            b_af = b_a.to(gl.float32)
            b_sq2 += b_af * b_af
        async_copy.wait_group(0)

        b_acc = b_hi_acc + b_lo_acc
        i_o = i_s if ATOMIC_SUMS else i_t
        o_m = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        p_d = d_ptr + i_o.to(gl.int64) * stride_dt + gl.expand_dims(o_m.to(gl.int64) * N, 1) + gl.expand_dims(o_n, 0)
        m_d = gl.expand_dims(o_m < M, 1) & gl.expand_dims(o_n < N, 0)
        # The operand layout has no reduction; the square sums are moved once per program.
        b_sq = gl.sum(gl.convert_layout(b_sq2, L_SQ), axis=1)
        o_ms = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_SQ))
        p_sq = sq_ptr + i_o.to(gl.int64) * stride_st + o_ms
        if ATOMIC_SUMS:
            gl.atomic_add(p_d, b_acc, mask=m_d, sem="relaxed")
            gl.atomic_add(p_sq, b_sq, mask=o_ms < M, sem="relaxed")
        else:
            gl.store(p_d, b_acc, mask=m_d)
            gl.store(p_sq, b_sq, mask=o_ms < M)


def kernel():
    """The Gluon kernel (requires :func:`nsa_backend.kernels._gluon.gluon_importable`)."""
    return _mhc_prenorm_gemm_gluon_kernel


__all__ = ["kernel", "usable"]
