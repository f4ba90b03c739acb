"""Launch configurations of the top-k kernels (``nsa_backend/kernels/topk.py``).

:func:`use_resident_path` and :func:`use_row_path` choose among the three paths of the kernel
module:

- register-resident path (at least ``RESIDENT_MIN_ROWS`` rows of at most ``RESIDENT_MAX_N``
  columns, ``topk <= ROW_MAX_TOPK``: prefill): one launch, :func:`resident_config` gives the
  :class:`ResidentConfig` (warps, persistent programs per SM, tile of the second pass) by row
  length; :func:`resident_sizes` the columns held in registers;
- whole-row path (other rows with ``topk <= ROW_MAX_TOPK``: decode rows and long rows): one
  launch, :func:`row_config` gives the :class:`RowConfig` (tile size, warps, persistent programs
  per SM, prefetch). Rows longer than :func:`row_capacity` are resolved from a bound sampled on
  :func:`row_sample` keys;
- split path (``topk > ROW_MAX_TOPK``): four launches, two 256-bin histogram passes and a filter
  pass, each row split over :func:`row_split` programs streaming tiles of ``block`` elements,
  then one program per row that resolves the last 16 bits among at most
  :func:`candidate_capacity` candidates (:class:`TopkConfig`, :func:`topk_config`).

No tile lives in shared memory beyond reduction / scan scratch and histograms, so one
configuration fits every architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

# The histograms stay at 256 bins: on an H200 one 4096-bin pass cost about 3x a 256-bin pass, and
# one 256-bin level leaves too many candidates (a bin spans two octaves of the float range).
# Largest candidate list per row (entries of the threshold bin kept for the finishing kernel).
MAX_CANDIDATES = 4096
# Programs per SM the histogram and filter passes aim for.
PROGRAMS_PER_SM = 4
# Finishing kernel: elements per tile and warps.
FINISH_BLOCK = 1024
FINISH_NUM_WARPS = 4


@dataclass(frozen=True)
class TopkConfig:
    block: int
    num_warps: int


# (fewest rows, config), first match wins: many rows keep one program per row busy with small
# tiles; few rows are split over programs streaming larger tiles (H200 sweep: 1024 / 4 warps was
# best for 4096 rows of 32K, 4096 / 8 warps for 128 rows of 64K).
TOPK_CONFIGS: tuple[tuple[int, TopkConfig], ...] = (
    (1024, TopkConfig(1024, 4)),
    (0, TopkConfig(4096, 8)),
)

# Whole-row path: one program resolves whole rows. Rows longer than the capacity keep the keys
# above a bound taken from row_sample(...) evenly spaced keys, placed ROW_SIGMAS standard
# deviations of the sampled rank on the safe side (so that at least topk keys lie above it).
ROW_MAX_TOPK = 2048
ROW_MIN_CAPACITY = 4096
ROW_MAX_SAMPLE = 4096
ROW_SIGMAS = 4.0


@dataclass(frozen=True)
class RowConfig:
    block: int  # elements per streamed tile
    num_warps: int
    programs_per_sm: int  # persistent programs per SM (each loops over rows)
    capacity: int = 0  # rows up to this length resolve in registers (0: row_capacity(topk))
    prefetch: bool = False  # load the next tile before processing the current one


# H200 sweep of tile / warps / prefetch at 128 and 256 decode rows of 4K..64K columns and 4096
# rows of 64K: 2048 / 8 warps with prefetch was the best or within a few percent of it everywhere.
ROW_CONFIG = RowConfig(2048, 8, 2, prefetch=True)


def use_row_path(n: int, rows: int, topk: int) -> bool:
    """Whether ``rows`` rows of ``n`` columns run the whole-row path (else the register-resident
    path, see :func:`use_resident_path`, or for ``topk > ROW_MAX_TOPK`` the split path)."""
    return topk <= ROW_MAX_TOPK and not use_resident_path(n, rows, topk)


# Register-resident path: one program holds a row of at most `capacity` columns in registers and
# finds the topk-th largest key with one reduction per key bit (longer rows, only with an explicit
# capacity: chunk by chunk, the top topk of each chunk kept). Taken for at least RESIDENT_MIN_ROWS
# rows of at most RESIDENT_MAX_N columns (topk <= ROW_MAX_TOPK), where it replaced the split path.
# H200, 4096 causal rows, topk 2048, against the split path / torch.topk: 0.253 / 0.407 / 0.725 ms
# at 8K columns, 0.611 / 0.830 / 1.094 ms at 16K, 1.338 / 1.611 / 1.860 ms at 32K; at 64K rows
# chunked by 32K took 3.36 ms against 2.52 ms for the whole-row path, so longer rows stay there.
RESIDENT_MIN_ROWS = 1024
RESIDENT_MAX_N = 32768
RESIDENT_MAX_CAPACITY = 32768


@dataclass(frozen=True)
class ResidentConfig:
    num_warps: int
    programs_per_sm: int  # persistent programs per SM (each loops over rows)
    capacity: int = 0  # columns held in registers (0: the next power of two >= n, capped)
    emit_block: int = 1024  # the selection is written from tiles of this size read again


# (largest n, config), first match wins; at most 64 keys per thread (H200: 127-155 registers,
# no spills). The H200 sweep at 8K / 16K / 32K columns picked 4 warps with tiles of 1024,
# 8 warps with tiles of 2048, 16 warps with tiles of 4096 (2048: within 1%).
RESIDENT_CONFIGS: tuple[tuple[int, ResidentConfig], ...] = (
    (8192, ResidentConfig(4, 8, emit_block=1024)),
    (16384, ResidentConfig(8, 2, emit_block=2048)),
    (32768, ResidentConfig(16, 1, emit_block=4096)),
)


def use_resident_path(n: int, rows: int, topk: int) -> bool:
    """Whether ``rows`` rows of ``n`` columns run the register-resident path."""
    return rows >= RESIDENT_MIN_ROWS and n <= RESIDENT_MAX_N and topk <= ROW_MAX_TOPK


def resident_config(n: int, rows: int) -> ResidentConfig:
    """Register-resident configuration for ``rows`` rows of ``n`` columns."""
    for max_n, cfg in RESIDENT_CONFIGS:
        if n <= max_n:
            return cfg
    return RESIDENT_CONFIGS[-1][1]


def resident_sizes(n: int, topk: int, cfg: ResidentConfig) -> tuple[int, int]:
    """(columns held in registers, scratch keys per program for the chunk winners of a long row)."""
    cap = cfg.capacity or min(_next_pow2(n), RESIDENT_MAX_CAPACITY)
    cap = max(cap, _next_pow2(2 * topk), 16)
    fin = _next_pow2(-(-n // cap) * topk) if n > cap else 0
    if cap > RESIDENT_MAX_CAPACITY or fin > RESIDENT_MAX_CAPACITY:
        raise ValueError(f"top-{topk} of rows of {n} columns needs more than {RESIDENT_MAX_CAPACITY} keys held")
    return cap, fin


def row_config(n: int, rows: int) -> RowConfig:
    """Whole-row configuration for ``rows`` rows of ``n`` columns."""
    return ROW_CONFIG


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def row_capacity(topk: int, cfg: RowConfig | None = None) -> int:
    """Keys a program keeps per row: rows up to this length are resolved without sampling."""
    if cfg is not None and cfg.capacity:
        return cfg.capacity
    return max(ROW_MIN_CAPACITY, _next_pow2(2 * topk))


def row_sample(cap: int) -> int:
    """Keys sampled per long row (runs of 8 consecutive keys)."""
    return max(8, min(cap, ROW_MAX_SAMPLE))


# logical_to_global_indices: elements per program and warps.
L2G_BLOCK = 1024
L2G_NUM_WARPS = 4


def topk_config(n: int, rows: int) -> TopkConfig:
    """Configuration for ``rows`` rows of ``n`` columns."""
    for min_rows, cfg in TOPK_CONFIGS:
        if rows >= min_rows:
            return cfg if n > cfg.block or cfg.block == 1024 else TopkConfig(1024, 4)
    return TOPK_CONFIGS[-1][1]


def row_split(rows: int, n: int, block: int, num_sms: int) -> int:
    """Programs per row of the streaming passes: enough to fill the GPU, at most one per tile."""
    want = -(-PROGRAMS_PER_SM * num_sms // max(rows, 1))
    return max(1, min(want, -(-n // block)))


def candidate_capacity(n: int) -> int:
    return max(1, min(n, MAX_CANDIDATES))


def shipped_configs() -> list[TopkConfig]:
    return [cfg for _, cfg in TOPK_CONFIGS]


def shipped_row_configs() -> list[RowConfig]:
    return [ROW_CONFIG]


def shipped_resident_configs() -> list[tuple[int, ResidentConfig]]:
    """(largest n, config) of every shipped register-resident configuration."""
    return list(RESIDENT_CONFIGS)
