"""Launch configurations of the lightning-indexer kernels (``nsa_backend/kernels/indexer/``).

Both logits kernels compute ``S^T = K @ Q^T`` tiles: ``block_n`` keys (the MMA M side) against
``cols`` query columns (the MMA N side). A column is one (query row, head) pair: heads are padded
to ``HP = max(16, next_pow2(H))`` and ``cols // HP`` query rows share a tile, so the head sum is a
reduction along the N side of the accumulator, inside each warp.

- ``RAGGED_CONFIGS[arch_kind]`` lists candidates for the prefill kernel, best first;
  :func:`ragged_config` returns the first whose estimated shared memory fits the architecture.
- ``PAGED_CONFIGS`` is the same for the decode kernel (deterministic: no autotuning, so the call
  can be captured in a CUDA graph); :func:`paged_chunk` then picks the keys per program from the
  shapes and the programs an SM runs at once (``PAGED_RESIDENT``).
- The ahead-of-time test compiles every configuration :func:`shipped_ragged_configs` /
  :func:`shipped_paged_configs` can return and checks the compiler's shared-memory number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nsa_backend.configs import FALLBACK_SHARED_MEMORY, shared_memory_budget  # noqa: F401 (module API)
from nsa_backend.kernels.aot import FP8_NATIVE_MIN_ARCH

HEAD_DIMS: tuple[int, ...] = (64, 128)
# Padded head counts (tl.dot needs at least 16 columns).
HEAD_BUCKETS: tuple[int, ...] = (16, 32, 64, 128)
# Paged decode: padded rows per request (next_n 1..4 -> 1, 2, 4).
NEXT_N_BUCKETS: tuple[int, ...] = (1, 2, 4)
PAGE_SIZES: tuple[int, ...] = (32, 64)

# Share of the budget the estimate may use (the compiler adds scratch for layout conversions).
SHARED_MEMORY_MARGIN = 0.85
# Keys per paged program, largest first (multiples of every block_n below).
PAGED_CHUNKS: tuple[int, ...] = (4096, 2048, 1024, 512)
# Paged decode programs an SM runs at once, by query columns, measured on sm_90 (64-key tiles, 6
# stages: 6 by shared memory up to 64 columns, then by registers); used as the estimate on every
# architecture, with PAGED_RESIDENT_DEFAULT for other column counts.
PAGED_RESIDENT: dict[int, int] = {16: 6, 32: 6, 64: 6, 128: 3, 256: 2, 512: 1}
PAGED_RESIDENT_DEFAULT = 4
# Waves of programs (programs / (resident * SMs)) :func:`paged_chunk` accepts: one wave that keeps
# every SM busy, or at least this many so that the last, partial one costs little.
PAGED_ONE_WAVE = (0.5, 1.0)
PAGED_MIN_WAVES = 2.0
# Fewest keys per program when a batch is cut to fill one wave (shorter programs are mostly prologue).
PAGED_MIN_CHUNK = 512


@dataclass(frozen=True)
class LogitsConfig:
    """One launch configuration of a logits kernel.

    ``scale_ahead`` (paged kernel): load the key scales one tile ahead in registers (the compiler
    pipelines only the MMA operands). ``max_regs``: register cap per thread (0: the compiler's choice).
    ``resident`` (paged kernel): programs an SM runs at once, for :func:`paged_chunk`.
    Paged kernel only: ``row_loop``: the query rows of a program take turns on each key tile (one
    ``[block_n, HP]`` accumulator live instead of ``[block_n, rows * HP]``; ``rows <= 4``);
    ``page_ahead``: with one-page tiles, the block-table entry of the scales is read a tile before
    the scales; ``k_mask``: mask the key loads (``False``: every key address is clamped inside the
    cache and keys that are not visible are set to ``-inf`` after the MMA, fewer instructions);
    ``head_slices`` (1 or 2; 2 needs ``row_loop`` and at least 32 padded heads): each row's heads are
    multiplied as that many products of ``HP / head_slices`` heads.
    """

    block_n: int
    cols: int
    num_warps: int
    num_stages: int
    scale_ahead: bool = True
    max_regs: int = 0
    resident: int = PAGED_RESIDENT_DEFAULT
    row_loop: bool = False
    page_ahead: bool = False
    k_mask: bool = True
    head_slices: int = 1

    def __post_init__(self) -> None:
        if self.head_slices not in (1, 2):
            raise ValueError(f"head_slices: expected 1 or 2, got {self.head_slices!r}")
        if self.head_slices == 2 and not self.row_loop:
            raise ValueError("head_slices: 2 needs row_loop=True (the slices are taken per query row)")

    def shared_bytes_estimate(self, head_dim: int, fp8_native: bool) -> int:
        """Pipelined key tiles plus the resident query tile (fp16 operands without native fp8)."""
        elem = 1 if fp8_native else 2
        return self.num_stages * self.block_n * head_dim * elem + self.cols * head_dim * elem


def arch_kind(arch: int | None) -> str:
    """``"wgmma"`` (sm_90), ``"big"`` (sm_80 / sm_100: large shared memory) or ``"small"``."""
    if arch is None:
        return "small"
    if arch // 10 == 9:
        return "wgmma"
    if shared_memory_budget(arch) >= 160 * 1024:
        return "big"
    return "small"


# sm_90 entries were tuned on an H200 (S 4096, N 32768 causal, D 128): 64 x 128 tiles with 4 stages
# reached 929 useful TFLOP/s at H 64, 64 x 256 (8 query rows per tile) 915 at H 32; tiles of 128
# keys, 8 warps, were 10-30 % slower. ``RAGGED_WGMMA_COLS`` picks the query columns per head count.
# The 99 KiB parts (sm_86 / 89 / 120 / 121) take 128-key tiles over 4 warps and 2 stages: under the sm120
# proxy (an H200, S 4096, N 16384 causal, D 128; bench/proxy_sweeps.py ragged) 1.16x (H 64) / 1.19x (H 32)
# faster than the 64-key tiles with 3 stages; 8 warps, 256 query columns and 32-key tiles were slower.
RAGGED_CONFIGS: dict[str, tuple[LogitsConfig, ...]] = {
    "wgmma": (LogitsConfig(64, 128, 4, 4), LogitsConfig(64, 128, 4, 3), LogitsConfig(64, 128, 4, 2)),
    "big": (LogitsConfig(128, 128, 8, 3), LogitsConfig(64, 128, 4, 3), LogitsConfig(64, 128, 4, 2)),
    "small": (LogitsConfig(128, 128, 4, 2), LogitsConfig(64, 128, 4, 3), LogitsConfig(64, 128, 4, 2),
              LogitsConfig(32, 128, 4, 2)),
}

RAGGED_WGMMA_COLS: dict[int, int] = {16: 256, 32: 256, 64: 128, 128: 128}
# The 100 KiB-per-SM parts by padded head count, from sweeps under the sm120 proxy with sm_120's shared
# memory per SM (an H100, S 4096, N 16384 causal, D 128): one query per tile. At 64 heads 64-key tiles over 3
# stages (sm_120, D 128: 25 KiB, 86 registers), 3.12 ms against 3.93 for RAGGED_CONFIGS["small"]'s first entry
# (34 KiB, 254 registers: two programs per SM); at 32 heads 128-key tiles over 2 stages, 1.54 ms against 2.87
# (and 1.98 for two queries of 32 heads per tile). Tiles of 64 or 32 query columns were not among the
# candidates of the earlier sweeps.
RAGGED_SMALL_BY_HEADS: dict[int, LogitsConfig] = {64: LogitsConfig(64, 64, 4, 3), 32: LogitsConfig(128, 32, 4, 2)}

# sm_90 decode entries tuned on an H200 (B 128, contexts 4K..64K, H 64, page 64; bytes of KV read per
# second over the copy rate, CUDA graph): 64-key tiles, 4 warps, 6 stages, scales a tile ahead reached
# 0.54 / 0.67 / 0.76 / 0.81 / 0.86 at next_n 1 and 0.40 / 0.50 / 0.56 / 0.57 / 0.58 at next_n 2 (with
# the chunks of :func:`paged_chunk`); 4 or 8 stages, 128-key tiles, 8 warps or register caps were slower.
# sm_90 entries by (HP, rows) that replace the table above, from a second H200 sweep (same shapes, L2
# evicted by reading; chunks of :func:`paged_chunk`), against the previous entries and chunk rule in
# the same script: next_n 1 with page ids ahead and unmasked key loads, 0.67 / 0.79 / 0.84 / 0.89 /
# 0.91 at 4K..64K (0.65 / 0.75 / 0.80 / 0.84 / 0.87); next_n 2 with the row loop and 8 stages (128
# registers: 4 programs per SM against 3), 0.48 / 0.56 / 0.59 / 0.61 / 0.63 (0.45 / 0.50 / 0.57 /
# 0.59 / 0.61). 8 to 12 stages without the row loop, register caps (spills in the loop), one row per
# program and 128-key tiles (two page ids per tile) were slower or equal.
PAGED_WGMMA_TUNED: dict[tuple[int, int], LogitsConfig] = {
    (64, 1): LogitsConfig(64, 64, 4, 6, page_ahead=True, k_mask=False, resident=6),
    (64, 2): LogitsConfig(64, 128, 4, 8, row_loop=True, k_mask=False, resident=4),
}
@dataclass(frozen=True)
class PagedGluonConfig:
    """Launch of the sm_90 Gluon paged kernel (``nsa_backend/kernels/indexer/sm90_gluon_paged.py``).

    ``num_stages``: key-tile buffers; ``resident``: programs an SM runs at once (for
    :func:`paged_chunk`); ``unroll``: key tiles per loop iteration (the last epilogue of an
    iteration does not overlap an MMA); ``tma``: copy the pages by TMA (else ``cp.async``);
    ``warp_specialize`` (with ``tma``): a one-warp loader partition feeds the compute warpgroup
    through mbarriers; ``max_regs``: register cap per thread of the launch (0: the compiler's
    choice; warp-specialised, the partitions share ``max_regs`` x 8 warps, the loader keeping
    ``loader_regs``).
    """

    num_stages: int
    resident: int
    unroll: int = 2
    tma: bool = True
    warp_specialize: bool = False
    max_regs: int = 0
    loader_regs: int = 24

    def shared_bytes_estimate(self, head_dim: int, heads: int, rows: int = 2, page: int = 64) -> int:
        """Key tiles and scales of every stage plus the query tiles of ``rows`` rows and the mbarriers."""
        return self.num_stages * (page * (head_dim + 4) + 16) + rows * heads * head_dim


# sm_90 Gluon paged kernel, H200 sweeps (B 128, H 64, page 64, CUDA graph; bench/results/h200/tuning/
# indexer_paged_gluon.md): warp-specialised TMA copies with 4 stages and 3 programs per SM reached
# 0.63 / 0.75 / 0.79 / 0.81 / 0.81 of the copy rate at 4K..64K with next_n 2 (the tl kernel: 0.50 /
# 0.57 / 0.60 / 0.63 / 0.65), and 0.70 / 0.82 / 0.89 / 0.93 / 0.95 with next_n 1 at 4 programs per SM
# (tl: 0.70 / 0.81 / 0.88 / 0.93 / 0.94). 5 or 6 stages were better only at 64K; 4 programs per SM at
# next_n 2 need a 64-register cap (spills). Caches whose page stride is not whole 128-byte rows take
# cp.async copies without a loader partition (next_n 2: 0.59 / 0.70 / 0.72 / 0.75 / 0.77). A call is
# routed to the kernel where the table of its copy engine has an entry (``paged_gluon_config``).
PAGED_GLUON: dict[int, PagedGluonConfig] = {
    1: PagedGluonConfig(num_stages=4, resident=4, warp_specialize=True, max_regs=64),
    2: PagedGluonConfig(num_stages=4, resident=3, warp_specialize=True, max_regs=80),
}
PAGED_GLUON_CP: dict[int, PagedGluonConfig] = {
    2: PagedGluonConfig(num_stages=4, resident=4, tma=False),
}
# Head counts (D 128, page 64) the paged launcher routes to the Gluon kernel on sm_90.
PAGED_GLUON_HEADS: frozenset[int] = frozenset(range(33, 65))


# The mma.sync archs with e4m3 (sm_89 / 120 / 121), Gluon allowed: one query row per request with 17..64 heads and
# two to four rows with 1..64 take the Gluon kernel of nsa_backend/kernels/indexer/sm89_gluon_paged.py (two rows
# per program, each row's q^T held in the MMA operand's registers, e4m3 products on these archs, 4 cp.async
# buffers: 35-41 KiB, two programs per SM). Under the sm120 proxy on an H100 (B 128, graph; fp16 products there) it
# read the cache at 0.754 / 0.836 / 0.854 of the copy rate at 8K / 32K / 64K with one row of 64 heads, 0.729 /
# 0.806 / 0.823 with two rows of 32 and 0.760 / 0.836 / 0.855 with two of 16, against 0.568 / 0.616 / 0.627,
# 0.534 / 0.573 / 0.581 and 0.488 / 0.528 / 0.533 for the tl entries of PAGED_SMALL_TUNED; one row of 32 heads
# 1.02-1.03x the tl entry, two rows of 64 (e4m3 products converted by ptxas) 1.01-1.05x, three and four rows
# 1.73-1.77x (64 heads), 2.39-2.54x (32) and 1.20-1.23x (16, four rows) (bench/results/h100-proxy-sm120/
# paged-mma-v2-rows). Chunks for four programs per SM ran 0.95-1.00x. One row of up to 16 heads keeps the tl
# entries (not timed against them).
PAGED_MMA_V2_ARCHS: tuple[int, ...] = (89, 120, 121)
PAGED_MMA_V2_HEADS: dict[int, frozenset[int]] = {
    1: frozenset(range(17, 65)), 2: frozenset(range(1, 65)), 3: frozenset(range(1, 65)), 4: frozenset(range(1, 65)),
}
PAGED_MMA_V2 = PagedGluonConfig(num_stages=4, resident=2, tma=False)


def paged_gluon_config(next_n: int, tma: bool) -> PagedGluonConfig | None:
    """Gluon launch for ``next_n`` rows on a cache that TMA can (``tma``) or cannot copy; ``None``:
    the call stays on the tl kernel."""
    return (PAGED_GLUON if tma else PAGED_GLUON_CP).get(next_n)


# Every 100 KiB-per-SM part (sm_86 / 89 / 120 / 121) by (HP, rows). At 64 heads and one row, two 32-head products
# per key tile (``head_slices``) over the row loop keep each key's head sum inside a warp. Under the mma.sync proxy
# on an H200 (B 128, CUDA graph, two passes) 1.08-1.09x faster with sm_120's and sm_89's configurations at contexts
# 8K / 32K (0.308 against 0.337 ms at 32K) and 1.38-1.43x with sm_86's (integer e4m3 decoding: 0.391 against
# 0.559 ms). Its chunks are planned for 4 programs per SM, what the compiled tile holds on sm_120 / 121 (106
# registers) and sm_89: under the proxy on an H100 (B 8-128, 8K-64K, graph) 1.07-1.14x faster than the plan for 6
# with sm_120's and sm_89's configurations (equal at B 16, 8K) and 1.00-1.05x with sm_86's (which holds 3 by shared
# memory, but chunks for 3 ran 0.95-0.96x those for 4 there).
# The other three entries come from sweeps with sm_120's configuration under the proxy on an H100 (B 128, 32K, page
# 64, graph): 64-key tiles over 3 stages with the row loop at 64 heads / 2 rows (0.61 ms against 0.72 for 128-key
# tiles over 2 stages; at 64 heads and two rows the head slices ran 0.96x), 128-key tiles over 2 stages at 32 heads /
# 1 row (0.22 against 0.30) and the row loop at 32 heads / 2 rows (0.32 against 0.37); bench/results/h100-proxy-sm120/
# sweeps and sweeps-51b65c0. They serve sm_86 and sm_89 too: under the proxy on an H100 (B 8-128, 8K-64K, graph)
# 1.16-1.45x faster than sm_89's table launches and 1.38-2.10x than sm_86's (1.03-1.20x / 1.20-1.57x at B 16, 8K),
# every result within 2.2e-7 of the table's (bench/results/h100-proxy-sm120/paged-small-table). Chunks for 3 or 5
# programs per SM ran 0.76-0.94x those for 4 with sm_120's configuration (equal at B 16, 8K).
PAGED_SMALL_TUNED: dict[tuple[int, int], LogitsConfig] = {
    (64, 1): LogitsConfig(64, 64, 4, 3, row_loop=True, head_slices=2, resident=4),
    (64, 2): LogitsConfig(64, 128, 4, 3, row_loop=True, resident=4),
    (32, 1): LogitsConfig(128, 32, 4, 2, resident=4),
    (32, 2): LogitsConfig(64, 64, 4, 3, row_loop=True, resident=4),
}

PAGED_CONFIGS: dict[str, tuple[LogitsConfig, ...]] = {
    "wgmma": (LogitsConfig(64, 0, 4, 6), LogitsConfig(64, 0, 4, 4), LogitsConfig(64, 0, 4, 2)),
    "big": (LogitsConfig(128, 0, 4, 3), LogitsConfig(64, 0, 4, 3), LogitsConfig(64, 0, 4, 2)),
    "small": (LogitsConfig(64, 0, 4, 3), LogitsConfig(64, 0, 4, 2), LogitsConfig(32, 0, 4, 2)),
}


def padded_heads(num_heads: int) -> int:
    """``HP``: the head count padded to a power of two, at least 16."""
    for hp in HEAD_BUCKETS:
        if num_heads <= hp:
            return hp
    raise ValueError(f"num_heads: expected at most {HEAD_BUCKETS[-1]}, got {num_heads}")


def padded_next_n(next_n: int) -> int:
    for n in NEXT_N_BUCKETS:
        if next_n <= n:
            return n
    raise ValueError(f"next_n: expected at most {NEXT_N_BUCKETS[-1]}, got {next_n}")


def fp8_native(arch: int | None) -> bool:
    return arch is not None and arch >= FP8_NATIVE_MIN_ARCH


def ragged_config(num_heads: int, head_dim: int, arch: int | None) -> LogitsConfig:
    """Prefill configuration for ``num_heads`` heads of ``head_dim`` on ``sm_<arch>``.

    ``cols`` is raised to ``HP`` when the padded head count is wider than the table entry.
    """
    hp = padded_heads(num_heads)
    budget = shared_memory_budget(arch) * SHARED_MEMORY_MARGIN
    native = fp8_native(arch)
    kind = arch_kind(arch)
    tuned = RAGGED_SMALL_BY_HEADS.get(hp) if kind == "small" else None
    if tuned is not None and tuned.shared_bytes_estimate(head_dim, native) <= budget:
        return tuned
    candidates = RAGGED_CONFIGS[kind]
    for cfg in candidates:
        cols = RAGGED_WGMMA_COLS[hp] if kind == "wgmma" else max(cfg.cols, hp)
        cfg = replace(cfg, cols=cols)
        if cfg.shared_bytes_estimate(head_dim, native) <= budget:
            return cfg
    last = candidates[-1]
    return replace(last, cols=max(last.cols, hp), num_stages=1)


def _paged_tuned(kind: str) -> dict[tuple[int, int], LogitsConfig]:
    """The entries by ``(HP, rows)`` of an arch kind that replace :data:`PAGED_CONFIGS` (none for most)."""
    if kind == "wgmma":
        return PAGED_WGMMA_TUNED
    if kind == "small":
        return PAGED_SMALL_TUNED
    return {}


def paged_config(num_heads: int, next_n: int, head_dim: int, arch: int | None) -> LogitsConfig:
    """Decode configuration: ``cols = rows * HP`` query columns per program.

    ``rows`` is the padded ``next_n`` (every page is read once for all rows of a request), halved
    while the tiles would not fit the architecture's shared memory.
    """
    hp = padded_heads(num_heads)
    budget = shared_memory_budget(arch) * SHARED_MEMORY_MARGIN
    native = fp8_native(arch)
    kind = arch_kind(arch)
    candidates = PAGED_CONFIGS[kind]
    rows = padded_next_n(next_n)
    tuned = _paged_tuned(kind).get((hp, rows))
    if tuned is not None and tuned.shared_bytes_estimate(head_dim, native) <= budget:
        return tuned
    while True:
        cols = rows * hp
        for cfg in candidates:
            resident = PAGED_RESIDENT.get(cols, PAGED_RESIDENT_DEFAULT)
            if cols > 256:  # keep the accumulator at <= 128 fp32 registers per thread
                cfg = replace(cfg, block_n=min(cfg.block_n, 64), cols=cols, num_warps=8, resident=resident)
            else:
                warps = 8 if cfg.block_n * cols > 128 * 128 else cfg.num_warps
                cfg = replace(cfg, cols=cols, num_warps=warps, resident=resident)
            if cfg.shared_bytes_estimate(head_dim, native) <= budget:
                return cfg
        if rows == 1:
            return replace(candidates[-1], cols=cols, num_stages=1)
        rows //= 2


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def paged_chunk(batch: int, max_context_len: int, num_sms: int, block_n: int,
                resident: int = PAGED_RESIDENT_DEFAULT) -> int:
    """Keys per paged program for ``batch`` requests of up to ``max_context_len`` keys.

    The grid has ``batch * cdiv(max_context_len, chunk)`` programs, ``resident * num_sms`` of which
    run at once. When every request fits in one wave, each request is cut into as many equal
    chunks (whole tiles, at least ``PAGED_MIN_CHUNK`` keys) as one wave holds, so that one wave
    fills every slot. Larger batches take the largest chunk of ``PAGED_CHUNKS`` giving one wave
    that keeps every SM busy, then the largest giving at least ``PAGED_MIN_WAVES`` waves, then the
    smallest.
    """
    slots = max(1, resident * num_sms)
    per_request = slots // max(batch, 1)
    if per_request >= 1:
        per_program = -(-max_context_len // per_request)
        return max(_round_up(per_program, block_n), _round_up(PAGED_MIN_CHUNK, block_n))
    chunks = [c for c in PAGED_CHUNKS if c % block_n == 0] or [block_n]
    waves = {c: batch * -(-max_context_len // c) / slots for c in chunks}
    lo, hi = PAGED_ONE_WAVE
    for chunk in chunks:
        if lo <= waves[chunk] <= hi:
            return chunk
    for chunk in chunks:
        if waves[chunk] >= PAGED_MIN_WAVES:
            return chunk
    return chunks[-1]


def shipped_ragged_configs(arch: int) -> list[tuple[int, int, LogitsConfig]]:
    """Every ``(HP, head_dim, config)`` :func:`ragged_config` can return on ``sm_<arch>``."""
    out = []
    for hp in HEAD_BUCKETS:
        for d in HEAD_DIMS:
            item = (hp, d, ragged_config(hp, d, arch))
            if item not in out:
                out.append(item)
    return out


def shipped_paged_configs(arch: int) -> list[tuple[int, int, int, LogitsConfig]]:
    """Every ``(HP, next_n bucket, head_dim, config)`` :func:`paged_config` can return
    (``config.cols // HP`` is the number of rows a program computes)."""
    out = []
    for hp in HEAD_BUCKETS:
        for nn in NEXT_N_BUCKETS:
            for d in HEAD_DIMS:
                item = (hp, nn, d, paged_config(hp, nn, d, arch))
                if item not in out:
                    out.append(item)
    return out
