"""Launch configurations of the top-k kernels (``nsa_backend/kernels/topk/``).

:func:`use_resident_path`, :func:`use_sieve_path` and :func:`use_row_path` choose among the four
paths of the kernel module:

- register-resident path (at least ``RESIDENT_MIN_ROWS`` rows of at most ``RESIDENT_MAX_N``
  columns, ``topk <= ROW_MAX_TOPK``: short prefill rows): one launch, :func:`resident_config`
  gives the :class:`ResidentConfig` (warps, persistent programs per SM, tile of the second pass)
  by row length; :func:`resident_sizes` the columns held in registers;
- sieve path (``topk <= ROW_MAX_TOPK``, rows longer than ``SIEVE_MIN_N``: longer prefill rows,
  at least ``SIEVE_MIN_ROWS`` decode rows, and fewer rows longer than ``SIEVE_SPLIT_MIN_N``): one
  launch, or two when rows are split over parts; :func:`sieve_config` gives the
  :class:`SieveConfig`, :func:`sieve_sizes` the candidate-list length, the sample and the
  longest row listed whole;
- whole-row path (the other rows with ``topk <= ROW_MAX_TOPK``: few or short decode rows): one
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

from dataclasses import dataclass, replace

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


# Sieve kernel: one program (two warps for prefill, four for decode) per row takes a lower bound of
# the topk-th key from `sample` keys, keeps the keys above it (about topk + 4 * sqrt(topk * n /
# sample)) in a list of at most `capacity` entries in one pass over the row, and resolves the list
# two key bits per pass. H200, top-2048, against the previous paths / torch.topk (same script):
# 4096 causal prefill rows at 16K / 32K / 64K columns 0.451 / 0.712 / 1.238 ms against 0.606 /
# 1.339 / 2.522 ms / 1.091 / 1.852 / 3.321 ms; 256 decode rows (graphed) at 8K / 16K / 32K / 64K
# 39 / 49 / 77 / 119 us against 56 / 73 / 104 / 164 us / 100 / 132 / 189 / 281 us.
SIEVE_MIN_CAPACITY = 8192
SIEVE_MIN_N = 4096  # shorter rows: register-resident or whole-row path
SIEVE_MIN_ROWS = 192  # fewer decode rows: whole-row path, unless longer than SIEVE_SPLIT_MIN_N
SIEVE_SPLIT_MIN_N = 32768
SIEVE_PART_MIN_N = 8192  # columns per part at least (rows split over parts)
SIEVE_MAX_SPLIT = 16
# Programs of the part kernel per SM: 4 fit at once on an H200 (119 registers, 4 warps); 128 rows
# of 64K columns split 4 / 5 / 8 ways took 71 / 83 / 71 us (5 ways: a second, partial wave).
SIEVE_PARTS_PER_SM = 4


@dataclass(frozen=True)
class SieveConfig:
    block: int  # elements per streamed tile of the row
    num_warps: int
    programs_per_sm: int  # persistent programs per SM (each loops over rows)
    sample: int = 2048  # keys sampled for the lower bound of rows listed by a bound
    capacity: int = 0  # candidate-list length (0: at least SIEVE_MIN_CAPACITY, 4 * topk)
    split: int = 1  # above 1: parts per row (one program each), then one merging program per row
    merge_block: int = 1024  # merging program: elements per tile and warps
    merge_warps: int = 4
    list_block: int = 0  # elements per tile of the candidate-list passes (0: block)
    max_regs: int = 0  # register cap per thread (0: the compiler's choice)


# H200 sweep (4096 prefill rows of 16K-64K, 256 decode rows of 4K-64K): prefill rows, 2 warps /
# 512-element tiles / 8 programs per SM with a 128-register cap (list passes over 1024-element
# tiles) beat 1 and 4 warps, 256 / 1024-element tiles and other caps by 2-40%; decode rows, 4 warps
# / 1024-element tiles beat 1, 2 and 8 warps; with fewer rows than SMs, each row split over 4-8
# parts took 71 us instead of 98 us (one program per row) at 128 rows of 64K columns.
SIEVE_PREFILL_CONFIG = SieveConfig(512, 2, 8, list_block=1024, max_regs=128)
SIEVE_DECODE_CONFIG = SieveConfig(1024, 4, 3)


def use_sieve_path(n: int, rows: int, topk: int) -> bool:
    """Whether ``rows`` rows of ``n`` columns run the sieve path."""
    return (topk <= ROW_MAX_TOPK and n > SIEVE_MIN_N and not use_resident_path(n, rows, topk)
            and (rows >= SIEVE_MIN_ROWS or n > SIEVE_SPLIT_MIN_N))


def sieve_config(n: int, rows: int, num_sms: int) -> SieveConfig:
    """Sieve configuration for ``rows`` rows of ``n`` columns on ``num_sms`` SMs: the prefill one for
    at least ``RESIDENT_MIN_ROWS`` rows, else the decode one, with rows split over parts when there
    are fewer rows than SMs: at most ``SIEVE_PARTS_PER_SM`` programs per SM (one wave), parts of at
    least ``SIEVE_PART_MIN_N`` columns."""
    if rows >= RESIDENT_MIN_ROWS:
        return SIEVE_PREFILL_CONFIG
    cfg = SIEVE_DECODE_CONFIG
    if rows < num_sms:
        split = min(SIEVE_PARTS_PER_SM * num_sms // max(rows, 1), -(-n // SIEVE_PART_MIN_N), SIEVE_MAX_SPLIT)
        if split > 1:
            return replace(cfg, split=split)
    return cfg


def sieve_sizes(topk: int, cfg: SieveConfig) -> tuple[int, int, int]:
    """(candidate-list length, keys sampled, longest row listed whole) of the sieve kernel. Longer
    rows list the keys above a sampled bound: about topk + 4 * sqrt(topk * n / sample) of them, so
    the list leaves room for the spread of that count."""
    cap = cfg.capacity or max(SIEVE_MIN_CAPACITY, _next_pow2(4 * topk))
    if cap >= 1 << 21 or cap >= 1024 * min(cfg.list_block or cfg.block, cfg.merge_block):
        # the list passes count per lane in 10-bit fields, per row in 21-bit fields
        raise ValueError(f"sieve list of {cap} entries: at most 1023 tiles per pass and 2**21 entries")
    sample = max(16, min(cfg.sample, cap))
    return cap, sample, min(cap, max(sample, _next_pow2(2 * topk)))


def use_row_path(n: int, rows: int, topk: int) -> bool:
    """Whether ``rows`` rows of ``n`` columns run the whole-row path (else the register-resident
    path, see :func:`use_resident_path`, the sieve path, see :func:`use_sieve_path`, or for
    ``topk > ROW_MAX_TOPK`` the split path)."""
    return topk <= ROW_MAX_TOPK and not use_resident_path(n, rows, topk) and not use_sieve_path(n, rows, topk)


# Register-resident path: one program holds a row of at most `capacity` columns in registers and
# finds the topk-th largest key with one reduction per key bit (longer rows, only with an explicit
# capacity: chunk by chunk, the top topk of each chunk kept). Taken for at least RESIDENT_MIN_ROWS
# rows of at most RESIDENT_MAX_N columns (topk <= ROW_MAX_TOPK), where it replaced the split path.
# H200, 4096 causal rows, topk 2048, against the split path / torch.topk: 0.253 / 0.407 / 0.725 ms
# at 8K columns, 0.611 / 0.830 / 1.094 ms at 16K, 1.338 / 1.611 / 1.860 ms at 32K; at 64K rows
# chunked by 32K took 3.36 ms against 2.52 ms for the whole-row path. The sieve path took over
# above 8K columns (0.285 ms against 0.252 ms at 8K; 0.451 against 0.606 ms at 16K); the 16K and
# 32K configurations remain for explicit use.
RESIDENT_MIN_ROWS = 1024
RESIDENT_MAX_N = 8192
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


def shipped_sieve_configs() -> list[SieveConfig]:
    """The sieve configurations :func:`sieve_config` returns (the split one with two parts)."""
    return [SIEVE_PREFILL_CONFIG, SIEVE_DECODE_CONFIG, replace(SIEVE_DECODE_CONFIG, split=2)]


def shipped_resident_configs() -> list[tuple[int, ResidentConfig]]:
    """(largest n, config) of every shipped register-resident configuration."""
    return list(RESIDENT_CONFIGS)
