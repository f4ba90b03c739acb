"""Launch-configuration sweeps of the portable kernels on a GPU, under the environment the caller sets.

Run under the sm120 proxy (Hopper MMA off, sm120 routing and configurations) to choose the SM120 / SM121
entries; each candidate is first compared with the shipped launch on the same inputs (``err``: largest
absolute difference), then timed. One JSON list per sweep is written to ``--out``. Where
``NSA_BACKEND_FORCE_ARCH`` names a proxied arch, every SM keeps only that arch's shared memory
(:func:`nsa_backend.bench.proxy.limit_shared_memory_per_sm`), so candidates run with the programs per SM
the proxied GPU would hold.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0 \\
        python bench/proxy_sweeps.py paged v4 decode ragged --out bench/results/h100-proxy-sm120/sweeps
    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 python bench/proxy_sweeps.py splits --out <dir>  # the Gluon decodes

- ``paged``: ``fp8_paged_mqa_logits`` at B 128, context 32K, H 64 / 32, next_n 1 / 2 (CUDA graph); the
  shipped tile also with smaller chunks (``resident`` 8 / 12 / 16) and with unmasked key loads.
- ``v4``: the DeepSeek-V4 decode tile (BLOCK_H, BLOCK_K, warps) at B 128, h_q 64 / 128, context 32K,
  top-k 512 plus the 128-token window (CUDA graph).
- ``ragged``: ``fp8_mqa_logits`` at 4096 queries over 16K causal keys, H 64 / 32 (eager calls); candidates
  whose shared-memory estimate exceeds the sm_120 budget are left out.
- ``decode``: the sparse MLA decode tile over the fp8_ds_mla cache at B 32 / 128, top-k 2048, h_q 128 / 64 /
  32 / 16 (tile shape, warps, stages; the top-k list split for one or two programs per SM; eager calls).
- ``prefill``: the sparse MLA prefill tile at s_q 4096, 32K bf16 keys, top-k 2048, h_q 128 / 64 / 32 / 16.
- ``splits``: the Gluon mma.sync decodes (fp8_ds_mla and bf16 caches), whose program fills an SM, at every split
  count of the top-k list they allow (1-8 at top-k 2048) and at batch sizes where one program a row and head block
  fills part of the last wave (B 40 / 64 / 80 / 100 / 128 / 200, s_q 1, h_q 16 / 32 / 64 / 128; CUDA graph);
  ``planned`` marks the count the launcher plans (its module's ``plan``) on this GPU's SMs. ``--splits-batches``,
  ``--splits-topk`` and ``--splits-heads`` take other shapes (comma-separated); ``--splits-any-count`` also times
  counts past the planner's bound of ``MIN_KEYS_PER_SPLIT`` keys a split, down to one 32-key tile (``SPLIT_WIDE``);
  ``--splits-kernels sm90`` times the sm_90 Gluon fp8 decodes instead (run without the proxy).
- ``mhc``: ``tf32_hc_prenorm_gemm`` at N 24, K 28672, M 1024-16384 (CUDA graph): the shipped route against
  the stacked bf16 parts of ``b`` with tiles whose programs per SM fit the 100 KiB an sm_120 SM holds,
  with and without programmatic dependent launch, and without it with each step's product waited for
  (``sync``, ``SYNC_MMA``; otherwise the launch decides by the GPU's MMA); ``of_copy`` is the read of ``a``
  over the copy rate measured in the same run, ``err`` the largest difference from the fp32 product over
  its RMS. ``--mhc-routed-only`` keeps the tiles the arch routes to, each variant timed twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys
from collections.abc import Callable

import torch

import nsa_backend.kernels.sparse_mla_decode.v4 as v4
from nsa_backend._settings import forced_arch
from nsa_backend.bench import peers, proxy
from nsa_backend.bench import sparse_mla as bench_sparse_mla
from nsa_backend.bench.indexer import paged_inputs, ragged_inputs
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import mhc as cfgs_mhc
from nsa_backend.configs.indexer import (
    SHARED_MEMORY_MARGIN,
    LogitsConfig,
    paged_config,
    ragged_config,
    shared_memory_budget,
)
from nsa_backend.configs.sparse_mla import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    AttnConfig,
    V4DecodeTile,
    decode_num_splits,
    split_keys,
)
from nsa_backend.kernels import indexer as kernels_indexer
from nsa_backend.kernels import mhc as kernels_mhc
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._launch import cdiv
from nsa_backend.kernels.aot import SHARED_MEMORY_PER_SM
from nsa_backend.kernels.sparse_mla_decode import GLUON_DECODE_HEADS, sparse_mla_decode_triton
from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as bf16_decode
from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as fp8_decode
from nsa_backend.kernels.sparse_mla_decode import sm90_gluon as sm90_decode
from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as sm90_ws_decode
from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

SWEEPS = ("paged", "v4", "decode", "prefill", "ragged", "mhc", "splits")


def _measure(run: Callable[[], torch.Tensor], ref: torch.Tensor, graph: bool,
             iters: int) -> tuple[float | None, object]:
    """``(ms, err)`` of one candidate, or ``(None, error text)`` where it does not launch."""
    try:
        got = run()
        finite = torch.isfinite(ref)
        err = (got.float()[finite] - ref.float()[finite]).abs().max().item()
        return bench_ms(run, 10, iters, graph=graph), err
    except (RuntimeError, ValueError) as exc:  # a launch the compiler or the launcher refuses
        return None, f"{type(exc).__name__}: {str(exc)[:80]}"


def sweep_paged() -> list[dict]:
    rows = []
    B, L, D = 128, 32768, 128
    for H, next_n in itertools.product((64, 32), (1, 2)):
        q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D)
        args = (q, cache, w, ctx, table, None, L)
        ref = kernels_indexer.fp8_paged_mqa_logits_triton(*args)
        base = paged_config(H, next_n, D, 120)
        cols = base.cols
        candidates = [base, LogitsConfig(64, cols, 4, 3, row_loop=next_n > 1, resident=4),
                      LogitsConfig(64, cols, 4, 4), LogitsConfig(64, cols, 4, 2), LogitsConfig(128, cols, 8, 2),
                      LogitsConfig(128, cols, 4, 2), LogitsConfig(64, cols, 4, 3, page_ahead=True, k_mask=False),
                      LogitsConfig(64, cols, 8, 3), LogitsConfig(32, cols, 4, 4)]
        # the shipped tile cut into smaller chunks (more programs than an SM holds at once), and unmasked
        candidates += [dataclasses.replace(base, resident=r) for r in (8, 12, 16) if r > base.resident]
        candidates += [dataclasses.replace(base, k_mask=False)]
        for cfg in candidates:
            def run(cfg=cfg, args=args):
                return kernels_indexer.fp8_paged_mqa_logits_triton(*args, config=cfg)
            ms, err = _measure(run, ref, graph=True, iters=40)
            rows.append({"H": H, "next_n": next_n, "cfg": str(cfg), "ms": ms, "err": err})
    return rows


def sweep_v4() -> list[dict]:
    rows = []
    for h_q in (64, 128):
        a = peers.v4_decode_inputs(128, h_q, 32768, peers.V4_WINDOW, peers.V4_TOPK, torch.device("cuda"))
        a = {k: a[k] for k in ("q", "kv_cache", "indices", "sm_scale", "topk_length", "extra_kv_cache",
                               "extra_indices", "extra_topk_length")}
        ref = v4.sparse_mla_v4_decode_triton(**a)[0]
        for tile in ((16, 16, 4), (16, 32, 4), (32, 16, 8), (16, 16, 8), (32, 32, 8)):
            def run(a=a, tile=tile):
                return v4.sparse_mla_v4_decode_triton(**a, tile=V4DecodeTile(*tile))[0]
            ms, err = _measure(run, ref, graph=True, iters=40)
            rows.append({"h_q": h_q, "cfg": list(tile), "ms": ms, "err": err})
    return rows


# Tiles of the sparse MLA sweeps (block_h, block_n, warps, stages).
ATTN_TILES = ((32, 32, 4, 2), (32, 16, 4, 2), (32, 16, 4, 3), (32, 32, 4, 1), (16, 32, 4, 2), (16, 16, 4, 2),
              (16, 32, 4, 3), (32, 32, 8, 2))


def sweep_decode() -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, h_q in itertools.product((32, 128), (128, 64, 32, 16)):
        a = bench_sparse_mla.decode_inputs(B, 1, h_q, 2048, torch.device("cuda"))
        args = (a["q"], a["kv_cache"], a["indices"], a["sm_scale"])
        ref = sparse_mla_decode_triton(*args)[0]
        ms, err = _measure(lambda args=args: sparse_mla_decode_triton(*args)[0], ref, graph=False, iters=60)
        rows.append({"B": B, "h_q": h_q, "cfg": "default", "ms": ms, "err": err})
        for tile in ATTN_TILES:
            cfg = AttnConfig(*tile)
            if cfg.block_h > max(h_q, 16):
                continue
            head_blocks = cdiv(h_q, cfg.block_h)
            for per_sm in (1, 2):
                splits = decode_num_splits(B, head_blocks, 2048, cfg.block_n, sms, cfg.block_h, per_sm)[0]

                def run(cfg=cfg, args=args, splits=splits):
                    return sparse_mla_decode_triton(*args, config=cfg, num_splits=splits)[0]
                ms, err = _measure(run, ref, graph=False, iters=60)
                rows.append({"B": B, "h_q": h_q, "cfg": str(cfg), "programs_per_sm": per_sm, "splits": splits,
                             "ms": ms, "err": err})
    return rows


# Batch sizes of the split sweep: on 132 SMs (an H100) one program a row fills 0.30-0.97 of the last wave.
SPLIT_SWEEP_BATCHES = (40, 64, 80, 100, 128, 200)
SPLIT_SWEEP_HEADS = (16, 32, 64, 128)
# Counts timed past the planner's bound with --splits-any-count (each as split_keys rounds it to whole tiles).
SPLIT_WIDE = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


def split_counts(topk: int, any_count: bool, block_n: int = 32) -> list[int]:
    """The split counts the sweep times at ``topk``: those the planners allow (at least ``MIN_KEYS_PER_SPLIT``
    keys a split), or with ``any_count`` those of ``SPLIT_WIDE`` down to one ``block_n`` tile a split."""
    if not any_count:
        return list(range(1, min(MAX_SPLITS, topk // MIN_KEYS_PER_SPLIT) + 1))
    counts = {split_keys(topk, n, block_n)[0] for n in SPLIT_WIDE if n <= min(MAX_SPLITS, cdiv(topk, block_n))}
    return sorted(counts)


# Decodes the split sweep times (--splits-kernels): the Gluon mma.sync ones (both caches; run under the proxy or on
# their archs) or the sm_90 Gluon fp8 ones (few heads, and the warp-specialised one from 17 heads; without the proxy).
SPLIT_KERNELS = ("mma_v2", "sm90")


def _split_kernels(kernels: str, h_q: int) -> list[tuple[str, Callable, Callable]]:
    """``(cache, plan, decode)`` of each decode the split sweep times at ``h_q`` heads: ``plan(B, s_q, h_q, topk,
    num_sms)`` is the split count the decode's launcher plans, ``decode(q, kv_cache, indices, sm_scale,
    num_splits=...)`` the call."""
    if kernels == "mma_v2":
        return [("fp8", lambda *a: fp8_decode.plan(*a)[0], fp8_decode.sparse_mla_decode_mma_v2),
                ("bf16", lambda *a: bf16_decode.plan(*a)[0], bf16_decode.sparse_mla_decode_bf16_mma_v2)]
    if h_q in GLUON_DECODE_HEADS:
        return [("fp8", lambda *a: sm90_decode.decode_gluon_plan(*a)[3], sm90_decode.sparse_mla_decode_gluon)]
    return [("fp8", lambda *a: sm90_ws_decode.plan(*a)[0], sm90_ws_decode.sparse_mla_decode_gluon_ws)]


def sweep_splits(batches: tuple[int, ...] = SPLIT_SWEEP_BATCHES, topks: tuple[int, ...] = (2048,),
                 heads: tuple[int, ...] = SPLIT_SWEEP_HEADS, any_count: bool = False,
                 kernels: str = "mma_v2") -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    sms = device_sms(dev)
    for topk, B in itertools.product(topks, batches):
        # one cache a batch size and top-k; q's first h_q heads
        a = bench_sparse_mla.decode_inputs(B, 1, max(heads), topk, dev)
        num_blocks, page = a["kv_cache"].shape[:2]
        caches = {"fp8": a["kv_cache"],
                  "bf16": torch.randn(num_blocks, page, 1, 576, device=dev, dtype=torch.bfloat16)}
        for h_q in heads:
            for cache, plan, decode in _split_kernels(kernels, h_q):
                args = (a["q"][:, :, :h_q].contiguous(), caches[cache], a["indices"], a["sm_scale"])
                planned = plan(B, 1, h_q, topk, sms)
                ref = decode(*args)[0]
                for n in split_counts(topk, any_count):
                    ms, err = _measure(lambda args=args, decode=decode, n=n: decode(*args, num_splits=n)[0], ref,
                                       graph=True, iters=40)
                    rows.append({"B": B, "h_q": h_q, "topk": topk, "cache": cache, "kernels": kernels, "splits": n,
                                 "planned": n == planned, "sms": sms, "ms": ms, "err": err})
        del a, caches
        torch.cuda.empty_cache()
    return rows


def sweep_prefill() -> list[dict]:
    rows = []
    s_q, s_kv, topk = 4096, 32768, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(s_kv, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32, generator=g)
    for h_q in (128, 64, 32, 16):
        q = torch.randn(s_q, h_q, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = flash_mla_sparse_fwd_triton(q, kv, idx, 576**-0.5)[0]
        ms, err = _measure(lambda q=q: flash_mla_sparse_fwd_triton(q, kv, idx, 576**-0.5)[0], ref, graph=False,
                           iters=10)
        rows.append({"h_q": h_q, "cfg": "default", "ms": ms, "err": err})
        for tile in ATTN_TILES:
            cfg = AttnConfig(*tile)
            if cfg.block_h > max(h_q, 16):
                continue

            def run(cfg=cfg, q=q):
                return flash_mla_sparse_fwd_triton(q, kv, idx, 576**-0.5, config=cfg)[0]
            ms, err = _measure(run, ref, graph=False, iters=10)
            rows.append({"h_q": h_q, "cfg": str(cfg), "ms": ms, "err": err})
    return rows


def sweep_ragged() -> list[dict]:
    rows = []
    S, N, D, arch = 4096, 16384, 128, 120
    budget = shared_memory_budget(arch) * SHARED_MEMORY_MARGIN
    for H in (64, 32):
        q, kv, w, ks, ke = ragged_inputs(S, N, H, D)
        args = (q, kv, w, ks, ke)
        ref = kernels_indexer.fp8_mqa_logits_triton(*args)
        candidates = [ragged_config(H, D, arch), LogitsConfig(64, 128, 4, 4), LogitsConfig(64, 128, 4, 2),
                      LogitsConfig(128, 128, 4, 2), LogitsConfig(128, 128, 8, 2), LogitsConfig(128, 128, 8, 3),
                      LogitsConfig(64, 256, 4, 3), LogitsConfig(64, 256, 8, 3), LogitsConfig(32, 128, 4, 4),
                      LogitsConfig(64, 128, 8, 3), LogitsConfig(128, 64, 4, 2), LogitsConfig(128, 64, 4, 3),
                      LogitsConfig(64, 64, 4, 3), LogitsConfig(64, 64, 4, 2), LogitsConfig(128, 128, 4, 1),
                      LogitsConfig(128, 64, 8, 2), LogitsConfig(64, 64, 4, 4), LogitsConfig(32, 64, 4, 4),
                      LogitsConfig(64, 32, 4, 3), LogitsConfig(64, 32, 4, 4), LogitsConfig(128, 32, 4, 2),
                      LogitsConfig(128, 32, 4, 3)]
        for cfg in candidates:
            if cfg.cols < H:  # a program holds every head of its queries
                continue
            if cfg.shared_bytes_estimate(D, True) > budget:
                rows.append({"H": H, "cfg": str(cfg), "ms": None, "err": "over the sm_120 shared-memory budget"})
                continue
            def run(cfg=cfg, args=args):
                return kernels_indexer.fp8_mqa_logits_triton(*args, config=cfg)
            ms, err = _measure(run, ref, graph=False, iters=10)
            rows.append({"H": H, "cfg": str(cfg), "ms": ms, "err": err})
    return rows


# Stacked-parts tiles (block_m, block_k, warps, stages) with the programs per SM they are planned for; tiles
# that spill on sm_120 / sm_86 (ahead-of-time compile: (128, 64, 4, 3), (64, 128, 4, 2)) are left out.
MHC_PARTS_TILES = (((64, 64, 4, 4), 1), ((64, 64, 4, 5), 1), ((128, 64, 8, 3), 1), ((128, 32, 8, 6), 1),
                   ((64, 32, 4, 8), 1), ((64, 64, 4, 3), 2), ((128, 32, 8, 4), 2), ((64, 32, 4, 6), 2),
                   ((128, 32, 8, 3), 2), ((128, 32, 4, 4), 2), ((256, 32, 8, 3), 1))


def _sweep_mhc_shape(M: int, N: int, K: int, copy: float, sms: int, tiles=MHC_PARTS_TILES) -> list[dict]:
    dev = torch.device("cuda")
    a = torch.randn(M, K, device=dev).to(torch.bfloat16)
    b = torch.randn(N, K, device=dev) / K**0.5
    ref = a.float() @ b.T
    rms = ref.pow(2).mean().sqrt().item()
    d = torch.empty(M, N, device=dev)
    sq = torch.empty(M, device=dev)
    block_n = cfgs_mhc.block_n_for(N)
    rows = []

    def measure(run: Callable[[], None], name: str, **extra) -> None:
        try:
            run()
            err = (d - ref).abs().max().item() / rms
            ms = bench_ms(run, 10, 40, graph=True)
            rows.append({"M": M, "cfg": name, "ms": ms, "of_copy": a.numel() * 2 / ms / 1e6 / copy, "err": err,
                         **extra})
        except (RuntimeError, ValueError) as exc:
            rows.append({"M": M, "cfg": name, "ms": None, "err": f"{type(exc).__name__}: {str(exc)[:80]}"})

    measure(lambda: kernels_mhc.tf32_hc_prenorm_gemm_triton(a, b, d, sq), "shipped")
    for tile, per_sm in tiles:
        cfg = cfgs_mhc.GemmConfig(*tile)
        # the programs per SM of a candidate must fit one sm_120 SM together
        if per_sm * cfg.shared_bytes_estimate(block_n, True, cfgs_mhc.PARTS_PRECISION) > SHARED_MEMORY_PER_SM[120]:
            continue
        plan = kernels_mhc.split_plan(M, N, K, 1, cfg.block_m, cfg.block_k, sms, per_sm)
        # each step's product waited for (SYNC_MMA) or not: the launch decides by the GPU's MMA (None)
        for pdl, sync in ((False, None), (True, None), (False, True)):
            def run(cfg=cfg, plan=plan, pdl=pdl, sync=sync):
                kernels_mhc._launch(a, b, d, sq, 1, block_n, cfg, plan, cfgs_mhc.PARTS_PRECISION, True, pdl, True,
                                    sync)
            measure(run, f"parts {list(tile)} per_sm {per_sm}" + (" pdl" if pdl else "") + (" sync" if sync else ""),
                    plan=list(plan))
    return rows


def sweep_mhc(routed_only: bool = False) -> list[dict]:
    dev = torch.device("cuda")
    copy = copy_gbps(dev, 2 * 2**30)
    arch, sms = kernels_mhc._arch_and_sms(dev)
    tiles = MHC_PARTS_TILES
    if routed_only:  # the tiles the arch routes to, twice (the second pass shows the spread)
        tiles = 2 * tuple((dataclasses.astuple(cfg), per_sm) for _, cfg, per_sm in cfgs_mhc.PARTS_ARCH_ROUTES[arch])
    rows = []
    for M in (1024, 2048, 4096, 8192, 16384):
        rows += _sweep_mhc_shape(M, 24, 28672, copy, sms, tiles)
        torch.cuda.empty_cache()
    return [*rows, {"copy_gbps": copy}]


def _int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; positive integers only (argparse reports the error)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", choices=SWEEPS, help="sweeps to run")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder for sweep_<name>.json")
    parser.add_argument("--mhc-routed-only", action="store_true",
                        help="mhc: only the tiles the arch routes to (each launch variant twice)")
    parser.add_argument("--splits-batches", type=_int_list, default=SPLIT_SWEEP_BATCHES,
                        help="splits: batch sizes (comma-separated positive integers)")
    parser.add_argument("--splits-topk", type=_int_list, default=(2048,),
                        help="splits: top-k sizes (comma-separated positive integers)")
    parser.add_argument("--splits-heads", type=_int_list, default=SPLIT_SWEEP_HEADS,
                        help="splits: query heads (comma-separated positive integers)")
    parser.add_argument("--splits-kernels", choices=SPLIT_KERNELS, default="mma_v2",
                        help="splits: the mma.sync Gluon decodes, or the sm_90 Gluon fp8 decodes (without the proxy)")
    parser.add_argument("--splits-any-count", action="store_true",
                        help="splits: also counts past the planner's bound, down to one 32-key tile a split")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the sweeps time GPU kernels: no CUDA device is visible")
    args.out.mkdir(parents=True, exist_ok=True)
    forced = forced_arch()
    if forced in proxy.PROXY_ARCHS:
        print(f"shared memory per SM limited to {forced}'s: carveout {proxy.limit_shared_memory_per_sm(forced)} %",
              flush=True)
    runners = {"paged": sweep_paged, "v4": sweep_v4, "decode": sweep_decode, "prefill": sweep_prefill,
               "ragged": sweep_ragged, "mhc": lambda: sweep_mhc(args.mhc_routed_only),
               "splits": lambda: sweep_splits(args.splits_batches, args.splits_topk, args.splits_heads,
                                              args.splits_any_count, args.splits_kernels)}
    for name in args.sweeps:
        rows = runners[name]()
        (args.out / f"sweep_{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        for row in rows:
            print(name, json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
