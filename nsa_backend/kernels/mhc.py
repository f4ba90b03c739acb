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

- stacked parts (sm_90, N in 17..32, M > 64): a small kernel splits ``b`` once per call into its
  bf16 parts, ``[2, N, K]`` for ``bf16x2`` (``b ~ hi + lo``, the shipped ``PARTS_PRECISION``) or
  ``[3, N, K]`` for ``bf16x3``; the GEMM loop multiplies the ``a`` tile with the parts stacked in one
  tile of ``2 * BLOCK_N`` (``4 * BLOCK_N``) rows (one tensor-core MMA per step, both operands straight
  from the pipelined shared-memory buffers) and adds the parts after the loop; square sums are kept
  per (row, column of the step) and reduced once after the loop. With ``SYNC_MMA`` (default) each
  step's product is waited for in that step: Triton 3.6 gives the ``a`` tile, which the square sums
  also read, one buffer fewer than the depth at which an in-flight product would be safe, so
  leaving the product in flight let the next load overwrite its ``a`` tile (wrong, run-to-run
  different sums in every variant where ptxas did not serialize the products itself; same speed
  where it did, as for the shipped tile). The tile and the programs per SM follow ``M``
  (``PARTS_ROUTES``). On the archs in ``PDL_ARCHS`` (sm_90, Triton >= 3.6) the GEMM and reduction
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

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nsa_backend import envs
from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels._arch import device_arch, device_sms
from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

__all__ = ["split_plan", "tf32_hc_prenorm_gemm_triton"]


@triton.heuristics({
    # The CPU interpreter multiplies bf16 tiles as raw integers: it gets exact fp32 products instead.
    "BF16_DOT_AS_FP32": lambda args: envs.triton_interpret(),
    "EVEN_K": lambda args: (args["K"] % args["BLOCK_K"] == 0 and args["SPLIT_K"] % args["BLOCK_K"] == 0
                            and args["CHUNK_K"] % args["BLOCK_K"] == 0),
    "PARTS_TILE": lambda args: _parts_tile(args["PRECISION"]),
    "SYNC_MMA": lambda args: cfgs.SYNC_MMA,
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


def _arch_and_sms(device: torch.device) -> tuple[int | None, int]:
    if device.type != "cuda":
        return None, 4
    arch, sms = device_arch(device), device_sms(device)
    if arch not in SHARED_MEMORY_LIMIT:
        arch = None
    return arch, sms


def split_plan(
    m: int,
    n: int,
    k: int,
    num_splits: int,
    block_m: int,
    block_k: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    min_chunk_k: int | None = None,
) -> tuple[int, int, int]:
    """``(split_k, chunk_k, num_chunks)``: how K is cut across programs.

    ``split_k`` (a multiple of 64) is the width of each of the caller's ``num_splits`` parts, as in
    ``nsa_backend.reference.split_bounds``. Each part is cut into ``num_chunks`` chunks of
    ``chunk_k`` columns (a multiple of ``block_k``, at least ``MIN_CHUNK_K`` when cut). The count
    minimises a bytes-per-slot cost: programs run in waves of ``PROGRAMS_PER_SM * num_sms``, each
    reading ``block_m * (chunk_k + PROGRAM_OVERHEAD_K)`` bf16 values, plus the fp32 partial sums
    written and read back when a part is cut.
    """
    split_k = 64 * triton.cdiv(k // 64, num_splits)
    tiles = triton.cdiv(m, block_m) * num_splits
    slots = (programs_per_sm or cfgs.PROGRAMS_PER_SM) * num_sms
    most = max(1, split_k // (min_chunk_k or cfgs.MIN_CHUNK_K))
    best: tuple[float, int, int] | None = None
    for want in range(1, most + 1):
        chunk_k = block_k * triton.cdiv(triton.cdiv(split_k, want), block_k)
        chunks = triton.cdiv(split_k, chunk_k)
        waves = triton.cdiv(tiles * chunks, slots)
        cost = waves * (chunk_k + cfgs.PROGRAM_OVERHEAD_K) * block_m * 2
        if chunks > 1:
            cost += chunks * num_splits * m * (n + 1) * 8 / slots
        if best is None or cost < best[0]:
            best = (cost, chunk_k, chunks)
    assert best is not None
    return split_k, best[1], best[2]


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, num_splits: int, device_index: int | None
          ) -> tuple[int, cfgs.GemmConfig, tuple[int, int, int], bool]:
    """``(block_n, config, (split_k, chunk_k, num_chunks), b_parts)`` of the default precision."""
    device = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
    arch, sms = _arch_and_sms(device)
    block_n, config = cfgs.gemm_config(n, m, arch)
    b_parts = cfgs.uses_b_parts(block_n, m, arch)
    per_sm = cfgs.parts_route(m)[1] if b_parts else cfgs.PROGRAMS_PER_SM
    return block_n, config, split_plan(m, n, k, num_splits, config.block_m, config.block_k, sms, per_sm), b_parts


@functools.cache
def _triton_version() -> tuple[int, int]:
    major, minor = (int("".join(ch for ch in piece if ch.isdigit()) or 0)
                    for piece in [*triton.__version__.split("."), "0"][:2])
    return major, minor


def _pdl_enabled(arch: int | None) -> bool:
    """Whether the stacked-parts kernels of ``sm_<arch>`` use programmatic dependent launch."""
    return arch in cfgs.PDL_ARCHS and _triton_version() >= cfgs.PDL_MIN_TRITON


def _parts_tile(precision: str) -> int:
    """Rows of the stacked-parts tile per ``BLOCK_N``: two parts, or three plus a zero part."""
    return 2 if precision == "bf16x2" else 4


def _num_parts(precision: str) -> int:
    return 2 if precision == "bf16x2" else 3


def _split_b(b: torch.Tensor, precision: str = "bf16x3", pdl: bool = False,
             zero_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[P, N, K]`` bf16 parts of the fp32 ``b``: ``b = hi + mid + lo`` (``bf16x3``) or
    ``b ~ hi + lo`` (``bf16x2``). ``pdl``: the next kernel (launched with programmatic dependent
    launch) may start early. ``zero_out``: ``(d, sqr_sum)`` (contiguous fp32) zeroed by the same
    launch."""
    N, K = b.shape
    parts = torch.empty((_num_parts(precision), N, K), dtype=torch.bfloat16, device=b.device)
    d, sq = zero_out if zero_out is not None else (b, b)
    d_numel, sq_numel = (d.numel(), sq.numel()) if zero_out is not None else (0, 0)
    grid = (triton.cdiv(max(N * K, d_numel), cfgs.SPLIT_B_BLOCK),)
    _mhc_prenorm_split_b_kernel[grid](b, parts, N * K, d, d_numel, sq, sq_numel, NUM_PARTS=_num_parts(precision),
                                      BLOCK=cfgs.SPLIT_B_BLOCK, USE_PDL=pdl, ZERO_OUT=zero_out is not None,
                                      num_warps=cfgs.SPLIT_B_NUM_WARPS)
    return parts


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int,
    block_n: int,
    config: cfgs.GemmConfig,
    plan: tuple[int, int, int],
    precision: str,
    b_parts: bool = False,
    pdl: bool = False,
    atomic_sums: bool = False,
) -> None:
    """Launch the kernels for ``d [S, M, N]`` and ``sqr_sum [S, M]`` (``S = num_splits``).

    With ``b_parts`` (``bf16x3`` or ``bf16x2``) ``b`` is split into its stacked bf16 parts by a first
    kernel; K chunks (``plan``) are added by a last kernel, or, with ``atomic_sums`` (stacked parts
    only), by the GEMM programs themselves with fp32 atomics into ``d`` and ``sqr_sum``, which the
    split kernel zeroes first (one launch less; the order of the additions, and so the last bits,
    then vary from call to call). With ``pdl`` (stacked parts, sm_90+) the GEMM and reduction kernels
    are launched with programmatic dependent launch: each starts while the kernel before it runs and
    waits for it in-kernel, which hides the launch gaps between them.
    """
    M, K = a.shape
    N = b.shape[0]
    split_k, chunk_k, num_chunks = plan
    slots = num_splits * num_chunks
    b_parts = b_parts and precision in ("bf16x3", "bf16x2")
    pdl = pdl and b_parts and not envs.triton_interpret()
    atomic_sums = atomic_sums and b_parts and num_chunks > 1
    if num_chunks == 1 or atomic_sums:
        out_d, out_sq, stride_dt, stride_st = d, sqr_sum, M * N, M
    else:
        ws = torch.empty((slots, M * N + M), dtype=torch.float32, device=a.device)
        out_d, out_sq, stride_dt, stride_st = ws, ws[:, M * N:], M * N + M, M * N + M
    b_in = _split_b(b, precision, pdl, (d, sqr_sum) if atomic_sums else None) if b_parts else b
    grid = (triton.cdiv(M, config.block_m), slots)
    _mhc_prenorm_gemm_kernel[grid](
        a, b_in, out_d, out_sq, M, N, K, split_k, chunk_k, num_chunks, stride_dt, stride_st,
        BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=config.block_k, PRECISION=precision, B_PARTS=b_parts,
        SQ_2D=b_parts, USE_PDL=pdl, LATE_DEPENDENTS=cfgs.LATE_DEPENDENTS, ATOMIC_SUMS=atomic_sums,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    if num_chunks > 1 and not atomic_sums:
        block_j, block = cfgs.reduce_blocks(num_chunks)
        grid = (triton.cdiv(M * N + M, block), num_splits)
        _mhc_prenorm_reduce_kernel[grid](ws, d, sqr_sum, M, N, num_chunks, BLOCK=block, BLOCK_J=block_j,
                                        USE_PDL=pdl, num_warps=cfgs.REDUCE_NUM_WARPS, launch_pdl=pdl)


def tf32_hc_prenorm_gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """Triton ``d = a @ b.T`` and ``sqr_sum = sum(a^2, -1)``, written in place (validated inputs).

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K]`` bf16, contiguous, ``K % 64 == 0``.
    b : torch.Tensor
        ``[N, K]`` fp32, contiguous, ``N % 8 == 0``, ``N <= 128``.
    d : torch.Tensor
        ``[M, N]`` fp32, or ``[S, M, N]`` with ``S = num_splits`` (partial sums over K).
    sqr_sum : torch.Tensor
        ``[M]`` fp32, or ``[S, M]`` with ``num_splits``.
    num_splits : int, optional
        Number of K partitions; split ``s`` covers the same K range as
        ``nsa_backend.reference.split_bounds(K, S)[s]`` (trailing splits may be empty: zeros).

    Notes
    -----
    Precision (``nsa_backend.configs.mhc.DEFAULT_PRECISION``), measured on an H200 against the
    fp32 reference for M = 2048, N = 24, K = 28672 (error = max |d - ref| / RMS(ref)):

    - ``"bf16x3"`` (default): ``b`` is split into three bf16 parts, each multiplied exactly with
      the bf16 ``a`` and accumulated in fp32, i.e. better than TF32 and about fp32: error
      ``1.4e-5`` (up to ``6.4e-5`` at M = 8192, N = 128, K = 7168 in the GPU fuzz; the fp32
      reference's own rounding is of that order), ``calc_diff`` against an fp64 product ``5e-12``.
    - ``"tf32"`` (DeepGEMM's choice): ``a`` is exact in TF32, ``b`` is rounded to TF32 (10-bit
      mantissa): error ``1.8e-3`` (``2.6e-3`` at most over a 240-case fuzz), ``calc_diff`` ``9e-8``.
      It was 1.6-2x slower than ``"bf16x3"`` on the H200.

    ``sqr_sum`` is an fp32 sum on CUDA cores in every mode (error ``3e-7`` of its RMS).

    With the stacked parts (the H200 route for N in 17..32) ``PARTS_PRECISION = "bf16x2"`` keeps 16
    significant bits of ``b`` (``|b - hi - lo| <= 2^-16 |b|``; TF32 keeps 11): H200 error against the
    fp32 reference 1.3e-5 / 2.0e-5 / 4.2e-5 / 8.6e-5 / 1.7e-4 of the output RMS at M = 1024 / 2048 /
    4096 / 8192 / 16384 (N = 24, K = 28672), against 8.8e-6 / 1.8e-5 / 4.1e-5 / 8.5e-5 / 1.7e-4 for
    three parts in the same run: the reference's own fp32 rounding dominates both.

    Determinism: where K is cut into chunks on the stacked-parts path, the chunks' partial sums are
    added with fp32 atomics (``nsa_backend.configs.mhc.ATOMIC_CHUNK_SUMS``), so the last bits may
    differ from call to call; under ``torch.use_deterministic_algorithms(True)`` a second kernel adds
    them in a fixed order instead (bit-identical results, one launch more: 0.68-0.69 instead of
    0.70-0.71 of the copy rate at M = 2048 on the H200). Every other path is deterministic.
    """
    M, K = a.shape
    N = b.shape[0]
    if M == 0:
        return
    splits = 1 if num_splits is None else num_splits
    index = None
    if a.device.type == "cuda":
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    block_n, config, plan, b_parts = _plan(M, N, K, splits, index)
    precision = cfgs.PARTS_PRECISION if b_parts else cfgs.DEFAULT_PRECISION
    pdl = b_parts and index is not None and _pdl_enabled(device_arch(a.device))
    atomic_sums = cfgs.ATOMIC_CHUNK_SUMS and not torch.are_deterministic_algorithms_enabled()
    _launch(a, b, d, sqr_sum, splits, block_n, config, plan, precision, b_parts, pdl, atomic_sums)


_GEMM_SIGNATURE: dict[str, str] = {
    "a_ptr": "*bf16", "b_ptr": "*fp32", "d_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
    "SPLIT_K": "i32", "CHUNK_K": "i32", "NUM_CHUNKS": "i32", "stride_dt": "i32", "stride_st": "i32",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRECISION": "constexpr",
    "B_PARTS": "constexpr", "SQ_2D": "constexpr", "USE_PDL": "constexpr", "LATE_DEPENDENTS": "constexpr",
    "EVEN_K": "constexpr", "PARTS_TILE": "constexpr", "BF16_DOT_AS_FP32": "constexpr", "SYNC_MMA": "constexpr",
    "ATOMIC_SUMS": "constexpr",
}
_SPLIT_B_SIGNATURE: dict[str, str] = {
    "b_ptr": "*fp32", "bp_ptr": "*bf16", "NK": "i32", "d_ptr": "*fp32", "D_NUMEL": "i32", "sq_ptr": "*fp32",
    "SQ_NUMEL": "i32", "NUM_PARTS": "constexpr", "BLOCK": "constexpr", "USE_PDL": "constexpr",
    "ZERO_OUT": "constexpr",
}
_REDUCE_SIGNATURE: dict[str, str] = {
    "ws_ptr": "*fp32", "d_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32", "NUM_CHUNKS": "i32",
    "BLOCK": "constexpr", "BLOCK_J": "constexpr", "USE_PDL": "constexpr",
}


# Arguments Triton sees as multiples of 16 at run time (aligned pointers; K, SPLIT_K and CHUNK_K are
# multiples of 64): the ahead-of-time compile uses the same hints, so loads are vectorised and
# pipelined through shared memory as in the real launch, and the shared-memory figure is the real one.
_GEMM_DIVISIBLE: tuple[str, ...] = ("a_ptr", "b_ptr", "d_ptr", "sq_ptr", "K", "SPLIT_K", "CHUNK_K")
_SPLIT_B_DIVISIBLE: tuple[str, ...] = ("b_ptr", "bp_ptr", "NK", "d_ptr", "sq_ptr")
_REDUCE_DIVISIBLE: tuple[str, ...] = ("ws_ptr", "d_ptr", "sq_ptr")


def _compile(kernel: Any, signature: dict[str, str], divisible: tuple[str, ...], constexprs: dict[str, Any],
             arch: int, num_warps: int, num_stages: int) -> Any:
    from nsa_backend.kernels.aot import compile_for_arch

    return compile_for_arch(kernel, signature, constexprs, arch, num_warps, num_stages, aligned=divisible)


def _gemm_variant(block_n: int, cfg: cfgs.GemmConfig, precision: str, b_parts: bool, pdl: bool = False,
                  atomic_sums: bool = False) -> tuple[dict[str, str], dict[str, Any]]:
    """Signature and constexprs of the GEMM kernel as :func:`_launch` runs it."""
    b_parts = b_parts and precision in ("bf16x3", "bf16x2")
    signature = dict(_GEMM_SIGNATURE, b_ptr="*bf16" if b_parts else "*fp32")
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": block_n, "BLOCK_K": cfg.block_k, "PRECISION": precision,
                  "B_PARTS": b_parts, "SQ_2D": b_parts, "USE_PDL": pdl and b_parts,
                  "LATE_DEPENDENTS": cfgs.LATE_DEPENDENTS,
                  "EVEN_K": cfg.block_k == 64, "PARTS_TILE": _parts_tile(precision),
                  "BF16_DOT_AS_FP32": False, "SYNC_MMA": cfgs.SYNC_MMA, "ATOMIC_SUMS": atomic_sums and b_parts}
    return signature, constexprs


def compile_shipped(arch: int) -> list[Any]:
    """Compile the kernels with every configuration shipped for ``sm_<arch>`` (ahead of time).

    The in-loop path's default precision is compiled with every configuration, the other precisions
    with the widest N tile (the most shared memory); the stacked-parts path with its precision and
    launch (``PARTS_PRECISION``, ``PDL_ARCHS``). Returns one
    :class:`nsa_backend.kernels.aot.CompiledKernel` per compilation; needs ``TRITON_INTERPRET``
    unset.
    """
    out = []
    shipped = cfgs.shipped_configs(arch)
    pdl = _pdl_enabled(arch)
    for block_n, cfg, b_parts in shipped:
        precisions = [cfgs.PARTS_PRECISION] if b_parts else [
            p for p in cfgs.PRECISIONS if p == cfgs.DEFAULT_PRECISION or block_n == cfgs.BLOCK_N_BUCKETS[-1]]
        # The stacked parts also run with their chunks added by atomics (ATOMIC_CHUNK_SUMS).
        sums = (False, True) if b_parts and cfgs.ATOMIC_CHUNK_SUMS else (False,)
        for precision in precisions:
            for atomic_sums in sums:
                signature, constexprs = _gemm_variant(block_n, cfg, precision, b_parts, pdl, atomic_sums)
                out.append(_compile(_mhc_prenorm_gemm_kernel.fn, signature, _GEMM_DIVISIBLE, constexprs, arch,
                                    cfg.num_warps, cfg.num_stages))
    parts = any(b_parts for _, _, b_parts in shipped)
    if parts:
        for zero_out in sorted({False, cfgs.ATOMIC_CHUNK_SUMS}):
            out.append(_compile(_mhc_prenorm_split_b_kernel, _SPLIT_B_SIGNATURE, _SPLIT_B_DIVISIBLE,
                                {"NUM_PARTS": _num_parts(cfgs.PARTS_PRECISION), "BLOCK": cfgs.SPLIT_B_BLOCK,
                                 "USE_PDL": pdl, "ZERO_OUT": zero_out}, arch, cfgs.SPLIT_B_NUM_WARPS, 3))
    for use_pdl in sorted({False, parts and pdl}):
        for block_j, block in cfgs.shipped_reduce_blocks():
            out.append(_compile(_mhc_prenorm_reduce_kernel, _REDUCE_SIGNATURE, _REDUCE_DIVISIBLE,
                                {"BLOCK": block, "BLOCK_J": block_j, "USE_PDL": use_pdl}, arch,
                                cfgs.REDUCE_NUM_WARPS, 3))
    return out
