"""Triton kernels of the mHC pre-norm GEMM (DeepSeek-V4): ``d = a @ b.T``, ``sqr_sum = sum(a^2)``.

Layouts (all contiguous, row-major):

- ``a``: ``[M, K]`` bf16, ``b``: ``[N, K]`` fp32, ``K % 64 == 0``, ``N % 8 == 0``, ``N <= 128``;
- ``d``: ``[S, M, N]`` fp32 and ``sqr_sum``: ``[S, M]`` fp32, where split ``s`` holds the partial
  sums over ``K`` columns ``[s * SPLIT_K, min((s + 1) * SPLIT_K, K))`` with
  ``SPLIT_K = 64 * ceil(K / 64 / S)`` (the partition of ``nsa_backend.reference.split_bounds``);
  ``S = 1`` is the 2-D form.

The op reads ``a`` once and ``b`` once per M tile (from L2), so it is memory bound. To fill the
GPU when ``M`` is small, every split is cut again into ``NUM_CHUNKS`` chunks of ``CHUNK_K`` columns,
one program per ``(M tile, chunk)``. With more than one chunk the partial sums go to an fp32
workspace ``[S * NUM_CHUNKS, M * N + M]`` and a second kernel adds them in a fixed order
(deterministic for a given shape and GPU), or, on the stacked-parts path by default
(``ATOMIC_CHUNK_SUMS``, unless ``torch.use_deterministic_algorithms(True)``), the GEMM programs add
them into ``d`` and ``sqr_sum`` with fp32 atomics, which the split kernel zeroes first: one kernel
less, results equal to the fp32 rounding of the additions but not bit-identical from call to call.

Two ways to multiply with the fp32 ``b``, chosen by ``nsa_backend.configs.mhc.uses_b_parts``:

- stacked parts (the archs of ``PARTS_ARCHS``, N in 17..32, M > 64): a small kernel splits ``b`` once per call into its
  bf16 parts, ``[2, N, K]`` for ``bf16x2`` (``b ~ hi + lo``, the shipped ``PARTS_PRECISION``) or
  ``[3, N, K]`` for ``bf16x3``; the GEMM loop multiplies the ``a`` tile with the parts stacked in one
  tile of ``2 * BLOCK_N`` (``4 * BLOCK_N``) rows (one tensor-core MMA per step, both operands straight
  from the pipelined shared-memory buffers) and adds the parts after the loop; square sums are kept
  per (row, column of the step) and reduced once after the loop. With ``SYNC_MMA`` (default) each
  step's product is waited for in that step: Triton 3.6 gives the ``a`` tile, which the square sums
  also read, one buffer fewer than the depth at which an in-flight product would be safe, so
  leaving the product in flight let the next load overwrite its ``a`` tile (wrong, run-to-run
  different sums in every variant where ptxas did not serialize the products itself; same speed
  where it did, as for the shipped tile). The tile and the programs per SM follow the arch and ``M``
  (``PARTS_ARCH_ROUTES``). On the archs in ``PDL_ARCHS`` (sm_90, Triton >= 3.6) the GEMM and reduction
  kernels use programmatic dependent launch: the GEMM starts while the split kernel runs, the
  reduction once every GEMM program has finished its loop (``LATE_DEPENDENTS``), and each waits for
  the kernel before it (``griddepcontrol``) before reading its output. H200 (N = 24, K = 28672, CUDA
  graph): ``a`` read at 0.56 / 0.70-0.71 / 0.82 / 0.91 / 0.97 of the copy rate at M = 1024 / 2048 /
  4096 / 8192 / 16384 with the atomic chunk sums, 0.53 / 0.68-0.69 / 0.81 / 0.91 / 0.97 with the
  chunk-sum kernel (a pure read of ``a``: 0.59 / 0.81 / 0.90 / 0.96 / 1.02). Sweeps, including the
  chunk sums and the split of ``b`` folded into the GEMM launch, chunk sums waiting on arrival
  counters and ``a`` prefetched into L2 during the split (none faster) and TF32 without parts (2-3x
  slower): ``bench/results/h200/tuning/mhc.parts.md``.
- in-loop split: every step splits the fp32 ``b`` tile into the three parts in registers and runs
  three MMAs (the path for other archs, other N tiles, small M and the ``tf32`` precision).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nsa_backend import envs


def _parts_tile(precision: str) -> int:
    """Rows of the stacked-parts tile per ``BLOCK_N``: two parts, or three plus a zero part."""
    return 2 if precision == "bf16x2" else 4


def _num_parts(precision: str) -> int:
    return 2 if precision == "bf16x2" else 3


@triton.heuristics({
    # The CPU interpreter multiplies bf16 tiles as raw integers: it gets exact fp32 products instead.
    "BF16_DOT_AS_FP32": lambda args: envs.triton_interpret(),
    "EVEN_K": lambda args: (args["K"] % args["BLOCK_K"] == 0 and args["SPLIT_K"] % args["BLOCK_K"] == 0
                            and args["CHUNK_K"] % args["BLOCK_K"] == 0),
    "PARTS_TILE": lambda args: _parts_tile(args["PRECISION"]),
})
# N stays unspecialised: with N a multiple of 16 (e.g. 32) the stacked-parts variant compiled under
# triton 3.6 for sm_90 gave wrong sums on the H200 (before SYNC_MMA: the in-flight product's a tile
# overwritten, see nsa_backend/configs/mhc.py); N = 24 (not specialised) was exact.
@triton.jit(do_not_specialize=["N", "NUM_CHUNKS"])
def _mhc_prenorm_gemm_kernel(
    a_ptr,
    b_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    B_PARTS: tl.constexpr,
    SQ_2D: tl.constexpr,
    USE_PDL: tl.constexpr,
    LATE_DEPENDENTS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTS_TILE: tl.constexpr,
    BF16_DOT_AS_FP32: tl.constexpr,
    SYNC_MMA: tl.constexpr,
    ATOMIC_SUMS: tl.constexpr = False,
):
    # a: [M, K] bf16. b: [N, K] fp32, or with B_PARTS its bf16 parts [P, N, K] (b = hi + mid + lo for
    # bf16x3, hi + lo for bf16x2). d: slot i_t at d_ptr + i_t * stride_dt, [M, N] fp32; sq: slot i_t at
    # sq_ptr + i_t * stride_st, [M] fp32. USE_PDL (programmatic dependent launch, sm_90+): the next
    # kernel may start its programs now (LATE_DEPENDENTS: once every program has finished its loop, so
    # that the waiting programs of the next kernel do not share the SMs during the loop); b (the parts)
    # is read after the split kernel completed. ATOMIC_SUMS: the chunks of split i_s add their partial
    # sums into slot i_s with fp32 atomics (the slots zeroed by the split kernel) instead of storing
    # slot i_t for the reduction kernel.
    if USE_PDL:
        if not LATE_DEPENDENTS:
            gdc_launch_dependents()
        gdc_wait()
    i_m, i_t = tl.program_id(0), tl.program_id(1)
    i_s = i_t // NUM_CHUNKS
    i_c = i_t % NUM_CHUNKS
    k_lo = i_s * SPLIT_K + i_c * CHUNK_K
    k_hi = tl.minimum(tl.minimum(i_s * SPLIT_K + SPLIT_K, K), k_lo + CHUNK_K)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    p_a = a_ptr + o_m.to(tl.int64)[:, None] * K + o_k[None, :]
    if B_PARTS:
        # rows r = part * BLOCK_N + n: the parts stacked in one tile (bf16x3: a fourth part of zeros).
        o_r = tl.arange(0, PARTS_TILE * BLOCK_N)
        m_r = ((o_r % BLOCK_N) < N) & (o_r < (PARTS_TILE - PARTS_TILE // 4) * BLOCK_N)
        p_b = b_ptr + ((o_r // BLOCK_N) * N + o_r % BLOCK_N).to(tl.int64)[:, None] * K + o_k[None, :]
        b_accp = tl.zeros([BLOCK_M, PARTS_TILE * BLOCK_N], dtype=tl.float32)
    else:
        p_b = b_ptr + o_n.to(tl.int64)[:, None] * K + o_k[None, :]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SQ_2D:
        b_sq2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    b_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            m_ak = m_m[:, None]
        else:
            m_k = (o_k + k) < k_hi
            m_ak = m_m[:, None] & m_k[None, :]
        # [BLOCK_M, BLOCK_K]
        b_a = tl.load(p_a + k, mask=m_ak, other=0.0)
        b_af = b_a.to(tl.float32)
        if SQ_2D:
            b_sq2 += b_af * b_af
        else:
            b_sq += tl.sum(b_af * b_af, axis=1)
        if B_PARTS:
            # [PARTS_TILE * BLOCK_N, BLOCK_K]
            if EVEN_K:
                b_b = tl.load(p_b + k, mask=m_r[:, None], other=0.0)
            else:
                b_b = tl.load(p_b + k, mask=m_r[:, None] & m_k[None, :], other=0.0)
            # [BLOCK_M, PARTS_TILE * BLOCK_N]
            if BF16_DOT_AS_FP32:
                b_accp = tl.dot(b_af, tl.trans(b_b.to(tl.float32)), b_accp, input_precision="ieee")
            else:
                b_accp = tl.dot(b_a, tl.trans(b_b), b_accp)
                if SYNC_MMA:
                    # Used in the same step, the product completes before the next loads are issued
                    # (see SYNC_MMA in nsa_backend/configs/mhc.py): "+ 0.0" is not folded (-0.0).
                    b_accp = b_accp + 0.0
        else:
            if EVEN_K:
                b_b = tl.load(p_b + k, mask=m_n[:, None], other=0.0)
            else:
                b_b = tl.load(p_b + k, mask=m_n[:, None] & m_k[None, :], other=0.0)
            if PRECISION == "tf32":
                # bf16 values are exact in TF32; only b is rounded.
                b_acc = tl.dot(b_af, tl.trans(b_b), b_acc, input_precision="tf32")
            elif PRECISION == "bf16x2":
                # b = b_hi + b_lo, two bf16 parts (16 significant bits): products exact, sums in fp32.
                b_hi = b_b.to(tl.bfloat16)
                b_lo = (b_b - b_hi.to(tl.float32)).to(tl.bfloat16)
                if BF16_DOT_AS_FP32:
                    b_acc = tl.dot(b_af, tl.trans(b_lo.to(tl.float32)), b_acc, input_precision="ieee")
                    b_acc = tl.dot(b_af, tl.trans(b_hi.to(tl.float32)), b_acc, input_precision="ieee")
                else:
                    b_acc = tl.dot(b_a, tl.trans(b_lo), b_acc)
                    b_acc = tl.dot(b_a, tl.trans(b_hi), b_acc)
            else:
                # b = b_hi + b_mid + b_lo, three bf16 parts: products are exact, sums in fp32.
                b_hi = b_b.to(tl.bfloat16)
                b_r = b_b - b_hi.to(tl.float32)
                b_mid = b_r.to(tl.bfloat16)
                b_lo = (b_r - b_mid.to(tl.float32)).to(tl.bfloat16)
                if BF16_DOT_AS_FP32:
                    b_acc = tl.dot(b_af, tl.trans(b_lo.to(tl.float32)), b_acc, input_precision="ieee")
                    b_acc = tl.dot(b_af, tl.trans(b_mid.to(tl.float32)), b_acc, input_precision="ieee")
                    b_acc = tl.dot(b_af, tl.trans(b_hi.to(tl.float32)), b_acc, input_precision="ieee")
                else:
                    b_acc = tl.dot(b_a, tl.trans(b_lo), b_acc)
                    b_acc = tl.dot(b_a, tl.trans(b_mid), b_acc)
                    b_acc = tl.dot(b_a, tl.trans(b_hi), b_acc)
    if USE_PDL and LATE_DEPENDENTS:
        gdc_launch_dependents()
    if B_PARTS:
        # [BLOCK_M, PARTS_TILE, BLOCK_N] -> sum of the parts (and the zero part)
        b_acc = tl.sum(tl.reshape(b_accp, [BLOCK_M, PARTS_TILE, BLOCK_N]), axis=1)
    if SQ_2D:
        b_sq = tl.sum(b_sq2, axis=1)

    i_o = i_s if ATOMIC_SUMS else i_t
    p_d = d_ptr + i_o.to(tl.int64) * stride_dt + o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    p_sq = sq_ptr + i_o.to(tl.int64) * stride_st + o_m
    if ATOMIC_SUMS:
        # No result is read back, so these compile to fire-and-forget reductions in L2.
        tl.atomic_add(p_d, b_acc, mask=m_m[:, None] & m_n[None, :], sem="relaxed")
        tl.atomic_add(p_sq, b_sq, mask=m_m, sem="relaxed")
    else:
        tl.store(p_d, b_acc, mask=m_m[:, None] & m_n[None, :])
        tl.store(p_sq, b_sq, mask=m_m)


@triton.jit
def _mhc_prenorm_split_b_kernel(
    b_ptr,
    bp_ptr,
    NK,
    d_ptr,
    D_NUMEL,
    sq_ptr,
    SQ_NUMEL,
    NUM_PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    ZERO_OUT: tl.constexpr = False,
):
    # b: [N, K] fp32 -> bp: [NUM_PARTS, N, K] bf16 with b = hi + mid + lo (NUM_PARTS = 3: each part the
    # bf16 rounding of what the previous parts leave, 24 significant bits in all, so the split is exact
    # for normal values) or b ~ hi + lo (NUM_PARTS = 2: 16 significant bits). USE_PDL: the GEMM kernel
    # that follows (launched with programmatic dependent launch) may start now; it waits for this one.
    # ZERO_OUT: also zero d [D_NUMEL] and sq [SQ_NUMEL] fp32, which the GEMM then adds its chunks into
    # (the grid covers max(NK, D_NUMEL) / BLOCK programs).
    if USE_PDL:
        gdc_launch_dependents()
    i_b = tl.program_id(0)
    o = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if ZERO_OUT:
        tl.store(d_ptr + o, tl.zeros([BLOCK], dtype=tl.float32), mask=o < D_NUMEL)
        tl.store(sq_ptr + o, tl.zeros([BLOCK], dtype=tl.float32), mask=o < SQ_NUMEL)
    m = o < NK
    b_b = tl.load(b_ptr + o, mask=m, other=0.0)
    b_hi = b_b.to(tl.bfloat16)
    b_r = b_b - b_hi.to(tl.float32)
    b_mid = b_r.to(tl.bfloat16)
    tl.store(bp_ptr + o, b_hi, mask=m)
    tl.store(bp_ptr + NK + o, b_mid, mask=m)
    if NUM_PARTS == 3:
        b_lo = (b_r - b_mid.to(tl.float32)).to(tl.bfloat16)
        tl.store(bp_ptr + 2 * NK + o, b_lo, mask=m)


@triton.jit
def _mhc_prenorm_reduce_kernel(
    ws_ptr,
    d_ptr,
    sq_ptr,
    M,
    N,
    NUM_CHUNKS,
    BLOCK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # ws: [S * NUM_CHUNKS, L] fp32 with L = M * N + M (partial d, then partial sqr_sum);
    # d: [S, M, N]; sq: [S, M]. Split i_s adds slots i_s * NUM_CHUNKS + j; BLOCK_J slots are loaded at
    # once and summed as a fixed tree, so the result does not depend on timing. USE_PDL: started
    # while the GEMM kernel runs, it waits for it to complete before reading.
    if USE_PDL:
        gdc_wait()
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    MN = M * N
    L = MN + M
    o = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    o_j = tl.arange(0, BLOCK_J)
    m_o = o < L
    p_ws = ws_ptr + i_s.to(tl.int64) * NUM_CHUNKS * L + o_j.to(tl.int64)[:, None] * L + o[None, :]
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, NUM_CHUNKS, BLOCK_J):
        # [BLOCK_J, BLOCK]
        b_ws = tl.load(p_ws + j * L, mask=((o_j + j) < NUM_CHUNKS)[:, None] & m_o[None, :], other=0.0)
        b_acc += tl.sum(b_ws, axis=0)
    tl.store(d_ptr + i_s.to(tl.int64) * MN + o, b_acc, mask=o < MN)
    tl.store(sq_ptr + i_s.to(tl.int64) * M + (o - MN), b_acc, mask=m_o & (o >= MN))
