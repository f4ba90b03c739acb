"""Launch configurations of the top-k kernels (``nsa_backend/kernels/topk.py``).

Top-k runs as four launches over rows of ``N`` columns (see the kernel module): two 256-bin
histogram passes (key bits 31..24, then 23..16) and a filter pass, each row split over
:func:`row_split` programs streaming tiles of ``block`` elements, then one program per row that
resolves the last 16 bits among at most :func:`candidate_capacity` candidates.

No tile lives in shared memory beyond the histograms and scan scratch, so one configuration
fits every architecture.
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
