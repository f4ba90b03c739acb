"""Launch configurations of the sparse-MLA attention kernel (``nsa_backend/kernels/sparse_mla_*.py``).

One program of ``_sparse_mla_fwd_kernel`` holds ``q`` for ``block_h`` heads (``block_h x 576``
bf16), a pipelined tile of ``block_n`` gathered keys (``block_n x 576`` bf16, plus the raw 656-byte
rows for the FP8 cache) and an fp32 accumulator of ``block_h x 512``. The tables below are data:

- ``PREFILL_CONFIGS[arch_class][block_h]`` / ``DECODE_CONFIGS[...]`` list candidates, best first;
  :func:`prefill_config` / :func:`decode_config` return the first whose estimated shared memory (a
  lower bound) fits ``SHARED_MEMORY_LIMIT`` of the architecture. The choice depends on shapes and the
  architecture only (deterministic, no autotuning: safe under CUDA-graph capture).
- The ahead-of-time test compiles every configuration :func:`shipped_configs` can return, for
  every target architecture, and checks the compiler's shared-memory number.
- Decode splits the top-k list over programs (``decode_num_splits``): as many splits as fit in one
  wave of ``PROGRAMS_PER_SM[block_h] * num_sms`` programs, each with at least ``MIN_KEYS_PER_SPLIT``
  keys. The sm_90 entries are the fastest of an H200 sweep at the benchmark shapes.
- Besides the tile, a configuration may read each tile's indices one iteration ahead (``idx_ahead``,
  which lets the compiler pipeline the key gather over ``num_stages`` buffers) and cap the registers
  per thread (``maxnreg``, more resident programs per SM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from nsa_backend.configs import (  # noqa: F401 (budget names stay part of this module's API)
    FALLBACK_SHARED_MEMORY,
    first_fitting,
    shared_memory_budget,
)

BLOCK_H_CHOICES: tuple[int, ...] = (16, 32, 64)
# Decode split-K planning: programs resident per SM by heads per program (a 64-head program holds
# about 148 KiB of shared memory on sm_90, so one per SM; the 16- and 32-head fp8 decode tiles of the
# 100 KiB-per-SM parts hold 40-45 KiB, two per SM; H200 sweeps put the best split at one full wave of
# programs, fewer splits rather than a second partial wave).
PROGRAMS_PER_SM: dict[int, int] = {16: 2, 32: 2, 64: 1}
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Merge kernel: heads per program and warps.
MERGE_BLOCK_H = 16
MERGE_NUM_WARPS = 4
# Output columns per merge program, widest first: narrower slices are taken while the programs of a call
# number fewer than MERGE_MIN_PROGRAMS_PER_SM per multiprocessor (H200, 16 heads, 4 splits, B 32: the
# merge takes 3.0 us in 64-column slices against 4.4 us in whole rows).
MERGE_BLOCK_D_CHOICES: tuple[int, ...] = (512, 256, 128, 64)
MERGE_MIN_PROGRAMS_PER_SM = 1


def merge_block_d(programs: int, d_v: int, num_sms: int) -> int:
    """Output columns per merge program for ``programs`` (rows times head blocks) programs of the full
    width ``d_v``: the widest slice of ``MERGE_BLOCK_D_CHOICES`` dividing ``d_v`` that gives at least
    ``MERGE_MIN_PROGRAMS_PER_SM * num_sms`` programs (the narrowest if none does; ``d_v`` itself if no
    choice divides it)."""
    fits = [b for b in MERGE_BLOCK_D_CHOICES if b <= d_v and d_v % b == 0]
    if not fits:
        return d_v
    for b in fits:
        if programs * (d_v // b) >= MERGE_MIN_PROGRAMS_PER_SM * num_sms:
            return b
    return fits[-1]

# Share of the budget the estimate (a lower bound) may use.
SHARED_MEMORY_MARGIN = 1.0


@dataclass(frozen=True)
class AttnConfig:
    """One launch configuration of ``_sparse_mla_fwd_kernel``."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    # Read each tile's indices one iteration ahead (a loop-carried register tile): the key gather then has
    # no in-iteration dependency and the compiler pipelines it over ``num_stages`` buffers.
    idx_ahead: bool = False
    # Register cap per thread (more resident programs per SM); None: the compiler's choice.
    maxnreg: int | None = None
    # fp8_ds_mla cache: dequantise each latent group once per tile into shared memory that both of its MMAs
    # read (on sm_120 the 32-head, 32-key tile then needs 70 KiB instead of 44, the 16-head, 16-key tile 45
    # instead of 40). Off: the compiler converts each group for each MMA, twice per tile.
    share_keys: bool = False
    # fp8_ds_mla cache: read each latent group's bytes again after the softmax (from the cache) and convert them
    # for ``P V`` there, instead of holding a converted copy in registers across the softmax (on sm_120 the 32-head,
    # 32-key tile then spills 4 B instead of 396, in 43 KiB). Not together with ``share_keys``.
    reread_keys: bool = False

    def __post_init__(self) -> None:
        if self.share_keys and self.reread_keys:
            raise ValueError("share_keys / reread_keys: a configuration takes at most one of them")

    def launch_options(self) -> dict:
        """Keyword arguments of the kernel launch besides the kernel's own parameters."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def shared_bytes_estimate(self, kv_fp8: bool) -> int:
        """Lower bound: the q tile and one bf16 key tile (plus its raw bytes for the FP8 cache); with
        ``reread_keys`` the latent groups pass through registers one at a time, and shared memory holds the q
        tile and 192 B per key (43 / 48 KiB for 32 / 64 keys at 32 heads, compiled for sm_120)."""
        if kv_fp8 and self.reread_keys:
            return 1152 * self.block_h + 192 * self.block_n
        return 1152 * (self.block_h + self.block_n) + (512 * self.block_n if kv_fp8 else 0)


def arch_class(arch: int | None) -> str:
    """``"sm90"`` (Hopper/Blackwell datacenter: wgmma, 227 KiB), ``"sm80"`` (A100-class) or ``"small"``."""
    if arch is None:
        return "small"
    if arch in (90, 100, 103):
        return "sm90"
    if arch in (80, 87):
        return "sm80"
    return "small"


# Heads per program at most, per arch class. On the 99 KiB parts a 64-head program fits only 16-key
# tiles next to its q tile, and the fp8 decode kernel spills; two 32-head programs per 64 heads with
# 32-key tiles run about twice as fast (mma.sync proxy of sm_120 on an H200, topk 2048: 64-head decode
# at B 128 1.13 ms as one 64-head program, 0.27 ms per 32-head program; 64-head prefill at s_q 4096
# 19.9 ms, 4.3 ms per 32 heads).
MAX_BLOCK_H: dict[str, int] = {"sm90": 64, "sm80": 64, "small": 32}


def heads_per_program(h_q: int, arch: int | None) -> int:
    """Heads per program of the ``tl`` sparse MLA kernels: the next power of two of ``h_q`` in
    [16, ``MAX_BLOCK_H`` of the arch class]."""
    return min(MAX_BLOCK_H[arch_class(arch)], max(16, 1 << max(0, h_q - 1).bit_length()))


# Shared memory measured by the ahead-of-time compile (bf16 prefill / fp8 decode, Triton 3.9):
# sm_90 (64, 64, 8, 2) 221 / 190 KiB, (16, 64, 4, 2) 94 / 110 KiB; sm_80 (64, 32, 8, 2) 115 / 119 KiB;
# sm_120 (64, 16, 8, 2) 94 / 97 KiB, (16, 32, 4, 2) 56 / 64 KiB. sm_90 prefill (16, 32, 4, 3) 55 KiB,
# (32, 64, 8, 2) 112 KiB; decode (16, 32, 4, 4, idx_ahead) 71 KiB.
PREFILL_CONFIGS: dict[str, dict[int, tuple[AttnConfig, ...]]] = {
    "sm90": {
        64: (AttnConfig(64, 64, 8, 2), AttnConfig(64, 32, 8, 2)),
        # H200 sweep (s_q 4096, topk 2048): capping registers at 128 keeps two (32 heads) / four (16 heads)
        # programs resident per SM: 3.63 vs 4.19 ms for (32, 32, 4, 3), 2.38 vs 2.53 ms for (16, 64, 4, 2).
        32: (AttnConfig(32, 64, 8, 2, maxnreg=128),),
        16: (AttnConfig(16, 32, 4, 3, maxnreg=128),),
    },
    "sm80": {
        64: (AttnConfig(64, 32, 8, 2),),
        32: (AttnConfig(32, 32, 4, 2),),
        16: (AttnConfig(16, 64, 4, 2),),
    },
    "small": {
        64: (AttnConfig(64, 16, 8, 2),),
        # 4 warps although the fp8 decode spills (336 B on sm_120): 8 warps (246 registers, no spill) ran
        # slower under the sm_120 proxy (32-head decode at B 128 0.39 vs 0.27 ms, prefill 7.9 vs 4.3 ms)
        32: (AttnConfig(32, 32, 4, 2),),
        # 16-key tiles: 37 KiB (bf16), two programs per 100 KiB SM; 16 heads at s_q 4096 took 5.00 against
        # 5.93 ms for (16, 32, 4, 2) (H100, proxy with sm_120's shared memory per SM)
        16: (AttnConfig(16, 16, 4, 2),),
    },
}

# Decode uses the prefill tiles, except on sm_90: two pipeline stages with 32 heads per program, and for
# 16 heads 32-key tiles whose indices are read one iteration ahead over four pipelined stages (H200, fp8
# cache, topk 2048: 181 vs 189 us at B 128, 62 vs 66 us at B 32 for (16, 64, 4, 2)).
DECODE_CONFIGS: dict[str, dict[int, tuple[AttnConfig, ...]]] = {
    **PREFILL_CONFIGS,
    "sm90": {
        64: PREFILL_CONFIGS["sm90"][64],
        32: (AttnConfig(32, 32, 4, 2),),
        16: (AttnConfig(16, 32, 4, 4, idx_ahead=True),),
    },
}


# The fp8_ds_mla decode where it differs from DECODE_CONFIGS. On the 100 KiB-per-SM parts the 16-head tile
# dequantises each latent group once (``share_keys``): 45 KiB, two programs per SM as before, no spill, 685
# instructions per pass of its loop on sm_120 against 902; it ran 1.17x faster at h_q 16 (B 128, top-k 2048:
# 0.227 against 0.266 ms). The 32-head tile would need 70 KiB that way, one program per SM, and ran 0.87-0.94x
# as fast at h_q 32-128 (H100, proxy with sm_120's shared memory per SM; bench/results/h100-proxy-sm120/
# fp8-decode-shared-keys). It keeps one pipeline stage (1.13-1.28x faster than two, bench/proxy_sweeps.py
# decode) and reads its groups again for P V (``reread_keys``): 43 KiB, two programs per SM, 4 B of spill
# against 396; 1.09-1.17x faster at h_q 32 / 64 / 128 with sm_120's and sm_89's configurations and 1.02-1.03x
# with sm_86's (H200, proxy; 1.059 against 1.184 ms at h_q 128, B 128; bench/results/h200-proxy-sm120/
# reread-and-head-slices). It takes 64 keys per pass: half the passes, so half the softmax and accumulator
# rescaling per key, in 48 KiB (still two programs per SM) at the price of a spill (520 B per thread on sm_120,
# 460 / 556 B on sm_89 / sm_86; over 8 warps nothing spills but one program fits per SM, and that ran only
# 1.00-1.07x the 32-key tile). Under the proxy (H100, B 128 / 32, top-k 2048, CUDA graph) 1.20-1.34x faster than
# the 32-key tile with sm_120's and sm_89's configurations at h_q 32 / 64 / 128 and 1.03-1.16x with sm_86's,
# although the proxy's own build of the tile spills more (736 B); bench/results/h100-proxy-sm120/
# decode-64-keys-and-paged-plan.
DECODE_FP8_CONFIGS: dict[str, dict[int, tuple[AttnConfig, ...]]] = {
    "small": {16: (AttnConfig(16, 16, 4, 2, share_keys=True),),
              32: (AttnConfig(32, 64, 4, 1, reread_keys=True),)},
}


def _pick(table: dict[str, dict[int, tuple[AttnConfig, ...]]], block_h: int, arch: int | None,
          kv_fp8: bool) -> AttnConfig:
    return first_fitting(table[arch_class(arch)][block_h], arch, SHARED_MEMORY_MARGIN,
                         lambda c: c.shared_bytes_estimate(kv_fp8))


def prefill_config(block_h: int, arch: int | None) -> AttnConfig:
    """Configuration of the prefill kernel for ``block_h`` heads per program on ``sm_<arch>``."""
    return _pick(PREFILL_CONFIGS, block_h, arch, False)


def decode_config(block_h: int, arch: int | None, kv_fp8: bool) -> AttnConfig:
    """Configuration of the decode kernel for ``block_h`` heads per program on ``sm_<arch>`` (over the
    fp8_ds_mla cache when ``kv_fp8``)."""
    if kv_fp8 and block_h in DECODE_FP8_CONFIGS.get(arch_class(arch), {}):
        return _pick(DECODE_FP8_CONFIGS, block_h, arch, kv_fp8)
    return _pick(DECODE_CONFIGS, block_h, arch, kv_fp8)


# kv_scale_format="pow2" (every scale a power of two below 2^8): the portable tile dequantises the fp8 cache with
# integer bits and one bf16 product per pair of keys (2 instructions per element, ``_sparse_mla_pow2_dequant``) where
# the archs without an fp8 unit (sm_80 / sm_86) decode e4m3 with integer operations into fp16 first (about 5). Same
# numbers: bit-identical outputs under the mma.sync proxy on an H100 (B 32 / 128, top-k 2048, CUDA graph), and with
# sm_86's configuration 1.09-1.41x faster (h_q 128, B 128: 0.840 against 1.066 ms), with sm_80's 1.03-1.29x. With
# sm_120's and sm_89's configurations, which convert through the fp8 unit, it ran 0.94-1.05x (slower at h_q 64 / 128,
# B 128), so those archs keep the fp8 unit (bench/results/h100-proxy-sm120/pow2-dequant).
POW2_DEQUANT_WITH_FP8_UNIT = False


def pow2_dequant(kv_scale_format: str | None, fp8_unit: bool) -> bool:
    """Whether the fp8 decode tile takes the power-of-two dequantisation for caches of ``kv_scale_format`` on an
    arch that converts e4m3 with its fp8 unit (``fp8_unit``) or with integer operations."""
    return kv_scale_format == "pow2" and (POW2_DEQUANT_WITH_FP8_UNIT or not fp8_unit)


def decode_num_splits(rows: int, head_blocks: int, topk: int, block_n: int, num_sms: int,
                      block_h: int = 64, programs_per_sm: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` for ``rows`` query rows: a function of the shapes only.

    The top-k list is split until ``rows * head_blocks`` programs fill one wave of
    ``programs_per_sm`` (default ``PROGRAMS_PER_SM[block_h]``) programs per SM, each split keeping at
    least ``MIN_KEYS_PER_SPLIT`` keys.
    """
    per_sm = programs_per_sm if programs_per_sm is not None else PROGRAMS_PER_SM.get(block_h, 1)
    programs = max(1, rows * head_blocks)
    want = max(1, per_sm * num_sms // programs)
    most = max(1, topk // MIN_KEYS_PER_SPLIT)
    return split_keys(topk, min(want, most, MAX_SPLITS), block_n)


def one_wave_splits(rows: int, head_blocks: int, topk: int, block_n: int, num_sms: int,
                    num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` for kernels whose program fills an SM's shared memory: the top-k list is
    split until ``rows * head_blocks`` programs make one wave of one program per SM (``decode_num_splits``), or
    into about ``num_splits`` splits where the caller gives them."""
    if num_splits is None:
        return decode_num_splits(rows, head_blocks, topk, block_n, num_sms, programs_per_sm=1)
    return split_keys(topk, num_splits, block_n)


# The split count of the decodes whose program fills an SM (``wave_filling_splits``): one split more costs about
# SPLIT_COST_TILES tiles of a program's time, plus SPLIT_COST_TILES_PER_WAVE tiles for each wave one split's programs
# fill (their fp32 partials, written and merged, grow with the programs), and a count other than the one-wave plan is
# taken only where it cuts the estimate by SPLIT_MIN_GAIN or more. Fitted on the split sweeps under the sm120 proxy on
# an H100 (bench/results/h100-proxy-sm120/sweeps-splits and splits-small-batches: B 1-200, h_q 16-128, top-k 512 and
# 2048, both caches, down to one tile a split).
SPLIT_COST_TILES = 0.125
SPLIT_COST_TILES_PER_WAVE = 3
SPLIT_MIN_GAIN = 0.10


# Called by every decode launch; the search over up to MAX_SPLITS counts takes tens of microseconds of host time,
# so the plans of the shapes seen are kept (a function of its integer arguments only).
@functools.lru_cache(maxsize=1024)
def wave_filling_splits(rows: int, head_blocks: int, topk: int, block_n: int, num_sms: int,
                        num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` for kernels whose program fills an SM's shared memory, by the tiles on the
    critical path: the count ``s``, at least the one-wave plan's (:func:`one_wave_splits`) and at most one
    ``block_n`` tile a split (and ``MAX_SPLITS``), that minimises ``ceil(programs * s / num_sms) * tiles per split
    + (s - 1) * (SPLIT_COST_TILES + SPLIT_COST_TILES_PER_WAVE * programs / num_sms)``, where that is at least
    ``SPLIT_MIN_GAIN`` below the one-wave plan's; the caller's ``num_splits`` as given.

    It departs from the one-wave plan where that leaves part of the GPU idle for the whole call (one split more
    than half fills it, or a last wave is partly filled) and where few programs leave whole SMs idle: there the
    top-k list is cut below ``MIN_KEYS_PER_SPLIT`` keys a split, since a few programs' partials cost little.
    """
    planned = one_wave_splits(rows, head_blocks, topk, block_n, num_sms, num_splits)
    if num_splits is not None:
        return planned
    programs = max(1, rows * head_blocks)
    most = max(1, min(MAX_SPLITS, topk // block_n))
    split_cost = SPLIT_COST_TILES + SPLIT_COST_TILES_PER_WAVE * programs / num_sms

    def cost(plan: tuple[int, int]) -> float:
        splits, per = plan
        waves = -(-programs * splits // num_sms)
        return waves * -(-per // block_n) + split_cost * (splits - 1)

    best = min((split_keys(topk, n, block_n) for n in range(planned[0], most + 1)), key=cost)  # ties: fewer
    return best if cost(best) < (1 - SPLIT_MIN_GAIN) * cost(planned) else planned


def split_keys(topk: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` for about ``num_splits`` splits of whole ``block_n`` tiles
    (the count can drop so that no split is empty)."""
    topk = max(topk, 1)
    per = -(-topk // num_splits)
    per = -(-per // block_n) * block_n
    return -(-topk // per), per


@dataclass(frozen=True)
class V4DecodeTile:
    """Launch of the DeepSeek-V4 decode kernel (``nsa_backend/kernels/sparse_mla_decode/v4.py``): heads and keys
    per program tile, warps, pipeline stages."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int = 2


# By arch class. 16 heads and 32 keys over 4 warps (82 KB of shared memory, no spill on any arch): natively on an
# H100 1.55x (h_q 64) / 1.15x (h_q 128) faster than 16-key tiles (bench/results/h100/v4-k32-0f8bca1). On the
# 100 KiB-per-SM parts, 32 heads and 32 keys over 8 warps (98 KB, one program per SM; ptxas spills 12 B on
# sm_120, none on sm_86): under the sm120 proxy with sm_120's shared memory per SM (an H100, B 128, context
# 32K, top-k 512 plus the 128-token window, CUDA graph) 0.25 / 0.48 ms at h_q 64 / 128 against 0.42 / 0.81 for
# the 16-head tile and 0.33 / 0.64 for 16 heads and 16 keys (49 KB, two per SM).
V4_DECODE_TILES: dict[str, V4DecodeTile] = {
    "sm90": V4DecodeTile(16, 32, 4),
    "sm80": V4DecodeTile(16, 32, 4),
    "small": V4DecodeTile(32, 32, 8),
}


def v4_decode_tile(arch: int | None) -> V4DecodeTile:
    """Tile of the DeepSeek-V4 decode kernel on ``sm_<arch>``."""
    return V4_DECODE_TILES[arch_class(arch)]


def shipped_configs(arch: int) -> list[tuple[str, AttnConfig, bool]]:
    """Every ``(kind, config, kv_fp8)`` the selectors can return on ``sm_<arch>``."""
    out: list[tuple[str, AttnConfig, bool]] = []
    for bh in (b for b in BLOCK_H_CHOICES if b <= MAX_BLOCK_H[arch_class(arch)]):
        item = ("prefill", prefill_config(bh, arch), False)
        if item not in out:
            out.append(item)
        for fp8 in (False, True):
            item = ("decode", decode_config(bh, arch, fp8), fp8)
            if item not in out:
                out.append(item)
    return out
