"""Launch configurations of the mHC pre-norm GEMM kernels (``nsa_backend/kernels/mhc/``).

The GEMM ``d = a @ b.T`` with ``N <= 128`` is bound by reading ``a`` (``M x K`` bf16) from memory,
so the tables below aim at bytes in flight, not at tensor-core shapes. Two paths:

- stacked parts (:func:`uses_b_parts`): ``b`` is split once per call into its bf16 parts
  (``PARTS_PRECISION``: two for ``bf16x2``, three for ``bf16x3``), which the GEMM loop multiplies as
  one tile of ``2 * block_n`` (``4 * block_n``) rows; one or two programs per SM with deep pipelines
  (``PARTS_ARCH_ROUTES``: by ``M`` on sm_90, one tile on the mma.sync archs), kernels chained by
  programmatic dependent launch on ``PDL_ARCHS``. Used on the archs it was measured for (``PARTS_ARCHS``:
  sm_90 on the H200, the mma.sync archs under the sm120 proxy), ``block_n == PARTS_BLOCK_N`` (N in
  17..32, DeepSeek-V4's N = 24) and ``M`` above the small-M tiles.
- otherwise ``b`` is read as fp32 and split inside the loop: ``GEMM_CONFIGS[block_n]`` lists
  candidate tiles, best first; :func:`gemm_config` returns the first one whose estimated shared
  memory fits the architecture (``SHARED_MEMORY_LIMIT``), and small ``M`` shrinks ``block_m`` to
  the next power of two (at least 16) to skip idle MMA rows.

The ahead-of-time test compiles every configuration :func:`shipped_configs` can return and checks
the compiler's shared-memory number. ``PROGRAMS_PER_SM`` and ``MIN_CHUNK_K`` drive the split of K
across programs (see ``nsa_backend.kernels.mhc.split_plan``): enough programs to fill the GPU, but no
program with fewer than ``MIN_CHUNK_K`` columns of ``a``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nsa_backend.configs import (  # noqa: F401 (budget names stay part of this module's API)
    FALLBACK_SHARED_MEMORY,
    first_fitting,
    shared_memory_budget,
)

# Widths of the N tile: N (a multiple of 8, at most 128) is padded to the next of these.
BLOCK_N_BUCKETS: tuple[int, ...] = (16, 32, 64, 128)
# block_m used for small M, smallest first (tl.dot needs at least 16 rows; 16 serves decode).
SMALL_BLOCK_M: tuple[int, ...] = (16, 64)

# Split-K planning (fitted to the H200 sweep in bench/results/h200/tuning/mhc.json): programs run in waves
# of PROGRAMS_PER_SM per SM, a chunk reads at least MIN_CHUNK_K columns, and starting a program
# costs about as much as reading PROGRAM_OVERHEAD_K more columns.
PROGRAMS_PER_SM = 2
MIN_CHUNK_K = 512
PROGRAM_OVERHEAD_K = 64

# Multiplication precision of the GEMM kernel: "bf16x3" (b split into three bf16 parts, a used as
# bf16: about float32 accuracy, 3 bf16 MMAs) or "tf32" (a converted to fp32, exact in TF32; b rounded
# to TF32, as DeepGEMM). On the H200 bf16x3 was 1.6-2.0x faster than tf32 (the fp32 operand path
# costs more than the extra MMAs), so it is the default.
DEFAULT_PRECISION = "bf16x3"
PRECISIONS: tuple[str, ...] = ("tf32", "bf16x3", "bf16x2")

# Stacked-parts path (H200 sweeps in bench/results/h200/tuning/mhc.parts.md): a small kernel splits b into
# [P, N, K] bf16 (SPLIT_B_BLOCK values per program); the GEMM program (tile and programs per SM by M:
# PARTS_ROUTES) multiplies the a tile with the stacked parts, keeps the square sums 2-D and reduces them
# once after the loop; K chunks are planned for the route's programs per SM.
PARTS_BLOCK_N = 32
# Precision of the stacked-parts path: "bf16x3" (three parts, about fp32) or "bf16x2" (b ~ hi + lo,
# 16 significant bits of b, still 32x finer than TF32's rounding; half the stacked tile and MMA work).
# H200, N = 24, K = 28672, graph: bf16x2 read a at 0.50 / 0.64 / 0.77 / 0.85 / 0.93 of the copy rate
# at M = 1024 .. 16384 against 0.46 / 0.59 / 0.69 / 0.74 / 0.77 for bf16x3 (same run).
PARTS_PRECISION = "bf16x2"
# Archs where the stacked-parts path launches its GEMM and reduction kernels with programmatic
# dependent launch (each starts while the previous kernel runs and waits for it in-kernel), with
# Triton >= PDL_MIN_TRITON (the release it was measured on; 3.4 lacks the in-kernel calls in this form).
# H200, graph, with SYNC_MMA, M = 1024 / 2048 / 4096 / 8192 / 16384, of the copy rate: 0.51 / 0.68 / 0.82 /
# 0.91 / 0.98 against 0.50 / 0.65 / 0.80 / 0.90 / 0.98 without (same run); the public op with and without
# it passed a 14.6k-case fuzz. The wrong sums seen with it on two 64-row tiles before came from the
# overwritten a tile that SYNC_MMA removes (those tiles are exact with it, PDL on or off).
PDL_ARCHS: tuple[int, ...] = (90,)
PDL_MIN_TRITON: tuple[int, int] = (3, 6)
# With PDL: the GEMM programs let the chunk-sum kernel start once they have all finished their loops (True)
# or as soon as they start (False: its programs then wait on the SMs during the whole GEMM). H200, graph,
# routed tiles, M = 1024 / 2048 / 4096 / 8192 / 16384: 0.53 / 0.68 / 0.83 / 0.94 / 1.01 of the copy rate
# against 0.51 / 0.68 / 0.82 / 0.93 / 1.01 (same run, sweep K).
LATE_DEPENDENTS = True
# The stacked-parts GEMM reads each pipelined a tile twice: the tensor-core product (asynchronous on
# sm_90) and the square sums (registers). Triton 3.6 gives that tile one shared-memory buffer fewer
# than the b tile (5 against 6 with 6 stages), so with the product left in flight over one step the
# load issued in that step overwrites the tile the product still reads. ptxas happens to serialize
# the products of the shipped tile (its C7515 note), which hides this; tiles and code variants where it
# does not (64-row tiles, N specialised to 32, extra code around the loop) gave wrong sums that
# differed from run to run. SYNC_MMA uses the product in the same step, so Triton waits for it
# before issuing the next loads: correct whatever ptxas does.
SYNC_MMA = True
# Compute-capability majors whose tl.dot is mma.sync (sm_80 / 86 / 89, sm_120 / 121; sm_90 too with Triton's
# Hopper MMA off, DISABLE_MMA_V3). mma.sync reads its operands into registers before the step's buffers are
# handed back, so nothing is in flight to wait for there, and SYNC_MMA is left out: its "+ 0.0" costs 32 fp32
# additions per thread per step, 138 against 105 instructions in the sm_120 loop of the shipped tile (ahead of
# time). Every other arch (wgmma on sm_90, tcgen05 on sm_100 / 103, any later one) keeps SYNC_MMA.
MMA_SYNC_MAJORS: tuple[int, ...] = (8, 12)


def sync_mma(capability: int | None, mma_v3_disabled: bool = False) -> bool:
    """Whether the stacked-parts GEMM waits for each step's product (``SYNC_MMA``) on a GPU of ``capability``
    (major * 10 + minor; ``None``: the CPU interpreter, where nothing runs asynchronously), with Triton's
    Hopper MMA disabled or not."""
    if capability is None or capability // 10 in MMA_SYNC_MAJORS:
        return False
    if capability // 10 == 9 and mma_v3_disabled:
        return False
    return SYNC_MMA


# Stacked parts with K cut into chunks: the GEMM programs add their partial sums into d and sqr_sum with
# fp32 atomics (zeroed by the split kernel) instead of leaving them to the chunk-sum kernel, unless
# torch.use_deterministic_algorithms(True) is in force (then the fixed-order sum kernel runs, bit-identical
# from call to call). H200, graph, N = 24, K = 28672, same run, alternating: M = 1024 / 1536 / 2048 / 3072 /
# 4096 read a at 0.556-0.566 / 0.642-0.645 / 0.704-0.709 / 0.741-0.742 / 0.817-0.819 of the copy rate against
# 0.525-0.526 / 0.615 / 0.682-0.687 / 0.712-0.715 / 0.811-0.812 with the sum kernel; equal at 8192 and 16384
# (one chunk or two). The shipped routes and K plans stayed the fastest with atomics (sweep S).
ATOMIC_CHUNK_SUMS = True
SPLIT_B_BLOCK = 2048
SPLIT_B_NUM_WARPS = 4

# Split reduction kernel: a program loads [block_j, block] partial sums at once, block_j the chunk
# count rounded up to a power of two (at most REDUCE_MAX_BLOCK_J), block_j * block = REDUCE_TILE.
REDUCE_TILE = 4096
REDUCE_MAX_BLOCK_J = 64
# REDUCE_TILE by block_j where another size was measured faster: H200, M = 2048 (8 chunks, the routed tile,
# LATE_DEPENDENTS), graph: 8192 values 40.0 us against 40.5 us for 4096 and 16384 (sweep L).
REDUCE_TILE_BY_BLOCK_J: dict[int, int] = {8: 8192}
REDUCE_NUM_WARPS = 4

# Share of the budget the estimate may use (the compiler adds scratch for layout conversions).
SHARED_MEMORY_MARGIN = 0.85


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of ``_mhc_prenorm_gemm_kernel``."""

    block_m: int
    block_k: int
    num_warps: int
    num_stages: int

    def shared_bytes_estimate(self, block_n: int, b_parts: bool = False, precision: str = "bf16x3") -> int:
        """Pipelined tiles of ``a`` (bf16) and ``b`` held in shared memory: ``b`` as fp32, or as the
        stacked bf16 parts (``4 * block_n`` rows, ``2 * block_n`` for ``bf16x2``) with ``b_parts``."""
        b_bytes = 2 * (2 if precision == "bf16x2" else 4) * block_n if b_parts else 4 * block_n
        return self.num_stages * self.block_k * (2 * self.block_m + b_bytes)


GEMM_CONFIGS: dict[int, tuple[GemmConfig, ...]] = {
    16: (GemmConfig(128, 64, 4, 4), GemmConfig(128, 64, 4, 3), GemmConfig(64, 64, 4, 3)),
    32: (GemmConfig(128, 64, 4, 4), GemmConfig(128, 64, 4, 3), GemmConfig(64, 64, 4, 3)),
    64: (GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 8, 3), GemmConfig(64, 64, 4, 3)),
    128: (GemmConfig(128, 64, 8, 3), GemmConfig(64, 64, 4, 3), GemmConfig(64, 64, 4, 2)),
}
# Stacked parts, bf16x2 with PDL and SYNC_MMA: (max_m, tile, programs per SM), the first row with
# M <= max_m. H200 (triton 3.6), graph, N = 24, K = 28672, of the copy rate at M = 1024 / 2048 / 3072 / 4096 /
# 8192 / 16384 (sweeps H-J, chunk sums started early): (128, 64, 8, 6), 1 per SM: 0.51-0.52 / 0.67-0.68 / 0.72 /
# 0.82 / 0.90-0.91 / 0.95-0.97; (64, 128, 4, 3), 2 per SM: 0.51 / 0.68-0.69 / 0.72 / 0.82 / 0.91-0.92 / 0.97;
# (128, 128, 8, 4), 1 per SM: 0.50 / 0.67-0.68 / 0.69 / 0.83 / 0.93 / 0.99-1.00. Also measured, not shipped:
# (64, 64, 4, 6) at 2 per SM 0.51 / 0.66 / - / 0.80 / 0.89 / 0.96, 7 and 8 stages, 256-row tiles (0.62-0.64 at
# M = 2048), BLOCK_K = 256 tiles (0.48-0.62 at M = 2048), (128, 128, 8, 5), (64, 128, 4, 4) at 2 per SM (0.66 at
# M = 2048); the K chunks added inside the GEMM launch by the last program of each row tile (arrival tickets) and
# b split by the GEMM programs themselves (no split kernel): no gain (0.62-0.63 at M = 2048 with either or
# both); the chunk-sum programs waiting on per-tile arrival counters instead of the GEMM kernel (0.66-0.67); a
# prefetched into L2 while b is split: slower at every M <= 8192; TF32 with a converted in registers (no split
# of b): 0.25-0.31; the parts made in registers (d^T = parts @ a^T, no split kernel): 0.39-0.68 (0.44-0.86 with
# 256-row tiles).
PARTS_ROUTES: tuple[tuple[int, GemmConfig, int], ...] = (
    (1024, GemmConfig(128, 64, 8, 6), 1),
    (3072, GemmConfig(64, 128, 4, 3), 2),
    (1 << 62, GemmConfig(128, 128, 8, 4), 1),
)
# The mma.sync archs (sm_80, and the 100 KiB SMs of sm_86 / 89 / 120 / 121): one tile for every M, planned at
# 2 programs per SM (2 x 49 KB by the estimate). Sweep under the sm120 proxy on an H200 (graph, N = 24,
# K = 28672; bench/proxy_sweeps.py mhc, candidates whose programs per SM fit 100 KiB and that do not spill):
# read a at 0.349 / 0.405 / 0.440 / 0.465 of the copy rate at M = 1024 / 2048 / 4096 / 8192 against 0.293 /
# 0.335 / 0.360 / 0.376 for the in-loop split of b (128, 64, 4, 3); (128, 32, 8, 6) at 1 per SM 0.321-0.414,
# 64-row tiles 0.23-0.40, 64-column steps 0.25-0.31; programmatic dependent launch equal for this tile and
# slower for the others (not used here).
PARTS_ROUTES_MMA_SYNC: tuple[tuple[int, GemmConfig, int], ...] = ((1 << 62, GemmConfig(128, 32, 8, 4), 2),)
# The mma.sync archs with Gluon (Triton >= 3.6, NSA_BACKEND_GLUON not 0) take the stacked-parts GEMM written in
# Gluon (nsa_backend/kernels/mhc/sm80_gluon.py: swizzled buffers, square sums from the MMA operand registers) with
# this tile and programs per SM: 128 x 64 per step, 8 warps, 4 buffers (96 KiB), one program per SM. The suite
# under the sm120 proxy on an H100 (graph, N = 24, K = 28672): a read at 0.566 / 0.694 / 0.790 / 0.848 / 0.882 of
# the copy rate at M = 1024 / 2048 / 4096 / 8192 / 16384, against 0.463 / 0.514 / 0.548 / 0.588 / 0.598 for the
# tl tile of PARTS_ROUTES_MMA_SYNC. In a sweep on the same machine 4 warps did as well, 64-row tiles at 3 buffers
# and 2 per SM reached 0.574-0.859, 2 buffers at 2 per SM 0.539-0.844, 32-column steps 0.484-0.687 (6 or 8
# buffers).
GLUON_PARTS_ARCHS: tuple[int, ...] = (80, 86, 89, 120, 121)
GLUON_PARTS_ROUTE: tuple[GemmConfig, int] = (GemmConfig(128, 64, 8, 4), 1)
# Registers per thread the Gluon GEMM may use (ptxas's maxnreg). Left to itself ptxas stops at 128 for the variant
# that stores its chunks (one chunk, or torch's deterministic mode) and spills 16-20 B, 2 local accesses per step in
# the loop on sm_80 / 86; with 160 it takes 146-154 and spills nothing on any arch (ahead of time). One program per
# SM holds 256 threads, so registers do not limit it.
GLUON_PARTS_MAX_REGS = 160
# Archs of the stacked-parts path, each with its routes.
PARTS_ARCH_ROUTES: dict[int, tuple[tuple[int, GemmConfig, int], ...]] = {
    90: PARTS_ROUTES, **dict.fromkeys((80, 86, 89, 120, 121), PARTS_ROUTES_MMA_SYNC)}
PARTS_ARCHS: tuple[int, ...] = tuple(PARTS_ARCH_ROUTES)


def block_n_for(n: int) -> int:
    """N tile width for ``n`` output columns."""
    for bn in BLOCK_N_BUCKETS:
        if n <= bn:
            return bn
    raise ValueError(f"n: expected at most {BLOCK_N_BUCKETS[-1]}, got {n}")


def parts_route(m: int, arch: int) -> tuple[GemmConfig, int]:
    """``(tile, programs per SM)`` of the stacked-parts path for ``m`` rows on ``sm_<arch>``
    (:data:`PARTS_ARCH_ROUTES`)."""
    routes = PARTS_ARCH_ROUTES[arch]
    return next(((cfg, per_sm) for max_m, cfg, per_sm in routes if m <= max_m), routes[-1][1:])


def uses_b_parts(block_n: int, m: int, arch: int | None, precision: str = DEFAULT_PRECISION) -> bool:
    """Whether ``b`` is split into stacked bf16 parts before the GEMM (the path measured on the H200)."""
    return (precision == "bf16x3" and arch in PARTS_ARCHS and block_n == PARTS_BLOCK_N
            and m > SMALL_BLOCK_M[-1])


def gemm_config(n: int, m: int, arch: int | None, precision: str = DEFAULT_PRECISION) -> tuple[int, GemmConfig]:
    """``(block_n, config)`` for ``n`` columns and ``m`` rows on ``sm_<arch>``."""
    block_n = block_n_for(n)
    if uses_b_parts(block_n, m, arch, precision):
        return block_n, first_fitting((parts_route(m, arch)[0],), arch, SHARED_MEMORY_MARGIN,
                                      lambda c: c.shared_bytes_estimate(block_n, True, PARTS_PRECISION))
    cfg = first_fitting(GEMM_CONFIGS[block_n], arch, SHARED_MEMORY_MARGIN,
                        lambda c: c.shared_bytes_estimate(block_n))
    for bm in SMALL_BLOCK_M:
        if m <= bm < cfg.block_m:
            cfg = replace(cfg, block_m=bm)
            break
    return block_n, cfg


def reduce_blocks(num_chunks: int) -> tuple[int, int]:
    """``(block_j, block)`` of the reduction kernel for ``num_chunks`` partial sums per split."""
    block_j = min(REDUCE_MAX_BLOCK_J, 1 << max(0, (num_chunks - 1).bit_length()))
    return block_j, max(64, REDUCE_TILE_BY_BLOCK_J.get(block_j, REDUCE_TILE) // block_j)


def shipped_reduce_blocks() -> list[tuple[int, int]]:
    """Every ``(block_j, block)`` :func:`reduce_blocks` can return for more than one chunk."""
    return sorted({reduce_blocks(c) for c in range(2, 2 * REDUCE_MAX_BLOCK_J + 1)})


def shipped_configs(arch: int) -> list[tuple[int, GemmConfig, bool]]:
    """Every ``(block_n, config, b_parts)`` :func:`gemm_config` can return on ``sm_<arch>``."""
    out: list[tuple[int, GemmConfig, bool]] = []
    route_ms = [max_m for max_m, _, _ in PARTS_ARCH_ROUTES.get(arch, ())[:-1]]
    for block_n in BLOCK_N_BUCKETS:
        for m in (*SMALL_BLOCK_M, *route_ms, 1 << 30):
            item = (*gemm_config(block_n, m, arch), uses_b_parts(block_n, m, arch))
            if item not in out:
                out.append(item)
    return out
