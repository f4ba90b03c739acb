"""Benchmark of the lightning-indexer logits: ragged (prefill) and paged (decode).

Shapes (full mode; quick mode keeps the smallest of each):

- ragged ``fp8_mqa_logits``: ``S = 4096`` queries at the end of ``N`` in {8K, 16K, 32K, 64K}
  causal keys (row ``i`` sees keys ``[0, N - S + i]``), ``H`` in {64, 32}, ``D = 128``. Useful
  FLOPs are ``2 * H * D * (valid query-key pairs)``; the ratio ``vs_fp8_mm`` divides by the
  ``torch._scaled_mm`` fp8 rate measured in the same run.
- paged ``fp8_paged_mqa_logits``: ``B = 128`` requests of ``L`` in {4K, 8K, 16K, 32K, 64K}
  tokens, ``next_n`` in {1, 2}, ``H = 64``, ``D = 128``, page 64, pages in random order. The rate
  is bytes of the KV cache read (``B * L * (D + 4)``) per second; ``vs_copy`` divides it by the
  device-to-device copy rate (bytes read + written) measured in the same run. The op is bounded by
  both that rate and the fp8 matmul rate (``2 * H * D`` = 16384 useful FLOPs per visible (row, key)
  pair against 132 bytes per key, :func:`nsa_backend.bench.roofline.paged_logits_flops`): its rows
  carry TFLOP/s, ``of_copy``, ``of_fp8_mm`` and ``of_roofline``, the larger of the two, their share
  of what a kernel at both limits would reach. ``read_kv`` (and
  ``read_kv-graph``) is a pure read of the same pages in the same order, timed the same way: no
  kernel that reads the cache once can be faster at that size, so ``vs_read_kv`` of a Triton row
  (the read's time over the row's) is its share of the attainable speed. At 4K the read itself
  stays well below the 2 GiB copy rate (ramp-up and the per-call cost weigh on a 69 MB read).
  ``read_kv_logits`` (and ``-graph``) reads the same pages and also writes the op's output, the
  ``[B, next_n, L]`` fp32 logits (zeros): the least traffic of any implementation of the op, so
  ``vs_read_kv_logits`` is the share of what a kernel that does no arithmetic at all would reach.
  ``tile_hot-graph`` is the Triton kernel with every request's block table pointing at the same
  ``HOT_PAGES`` pages, which stay in L2: the kernel's own speed with no DRAM traffic, so
  ``vs_tile_hot-graph`` of the graph row is how much of its time the cache reads add, and
  ``of_fp8_mm`` of the hot row is the kernel's share of the fp8 matmul rate.

Baselines: ``torch``, a vectorised plain-torch implementation (dequantise + bf16 matmul, chunked
over keys) of the kind that runs where no native kernel exists (SM120 today), and ``deep_gemm``
when the package imports. Rows of baselines carry ``ratios["triton_speedup"]`` = baseline ms /
Triton ms.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.roofline import paged_logits_flops
from nsa_backend.bench.timing import bench_ms, gbps, tflops

FP8 = torch.float8_e4m3fn
FAMILY = "indexer"
# Pages every request of the ``tile_hot`` rows reads (34 KB at D 128: resident in L2).
HOT_PAGES = 4
WARMUP_MS, REP_MS = 10.0, 40.0


def _row(op: str, shape: dict[str, Any], impl: str, ms: float | None, flops: float | None = None,
         nbytes: float | None = None, *, limit: list[str] | None = None, note: str | None = None,
         **ratios: float | None) -> dict[str, Any]:
    """A result row; ``limit`` (the measured limit the row is compared with) and ``note`` only when given."""
    row = {"family": FAMILY, "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": tflops(flops, ms),
           "gbps": gbps(nbytes, ms), "ratios": {k: v for k, v in ratios.items() if v is not None}}
    if limit:
        row["limit"] = limit
    if note:
        row["note"] = note
    return row


def _baseline_rows(op: str, shape: dict[str, Any], baselines: dict[str, Any], triton_ms: float | None,
                   flops: float | None, nbytes: float | None) -> list[dict[str, Any]]:
    """One row per baseline ``{impl: fn}``, with ``triton_speedup`` = baseline ms / ``triton_ms``."""
    rows = []
    for impl, fn in baselines.items():
        b_ms, b_note = _time(fn)
        rows.append(_row(op, shape, impl, b_ms, flops, nbytes, note=b_note,
                         triton_speedup=(b_ms / triton_ms) if (b_ms and triton_ms) else None))
    return rows


def _time(fn, graph: bool = False) -> tuple[float | None, str | None]:
    try:
        return bench_ms(fn, WARMUP_MS, REP_MS, graph=graph), None
    except Exception as exc:  # a failing implementation is reported, the others still run
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


@triton.jit
def _read_kv_pages_kernel(cache_ptr, table_ptr, out_ptr, logits_ptr, n_pages, stride_page, stride_table,
                          stride_lb, stride_lr, PAGE_WORDS: tl.constexpr, BLOCK: tl.constexpr, PAGES: tl.constexpr,
                          PAGE: tl.constexpr, NEXT_N: tl.constexpr):
    # One program reads PAGES consecutive block-table entries of one request, as int32 words; with
    # NEXT_N > 0 it also writes zeros over the logits of those pages' tokens for every row.
    i_b, i_p = tl.program_id(0), tl.program_id(1)
    o_w = tl.arange(0, BLOCK)
    o_t = tl.arange(0, PAGE)
    b_acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(PAGES):
        i_pg = i_p * PAGES + j
        if i_pg < n_pages:
            page = tl.load(table_ptr + i_b.to(tl.int64) * stride_table + i_pg).to(tl.int64)
            for w0 in range(0, PAGE_WORDS, BLOCK):
                m = w0 + o_w < PAGE_WORDS
                b_acc ^= tl.load(cache_ptr + page * stride_page + w0 + o_w, mask=m, other=0)
            for r in range(NEXT_N):
                p_l = logits_ptr + i_b.to(tl.int64) * stride_lb + r * stride_lr + i_pg * PAGE + o_t
                tl.store(p_l, tl.zeros([PAGE], dtype=tl.float32))
    tl.store(out_ptr + i_b * tl.num_programs(1) + i_p, tl.xor_sum(b_acc, axis=0))


READ_PAGES_PER_PROGRAM = 4


def read_kv_pages(cache: torch.Tensor, table: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Pure read of every page of ``table`` (``[B, n_pages]`` i32) in ``cache`` (``[P, page, 1, D + 4]`` u8).

    Returns the xor of each program's words (``[B * cdiv(n_pages, READ_PAGES_PER_PROGRAM)]`` i32, so the
    reads are not optimised away). With ``logits`` (``[B, next_n, >= n_pages * page]`` fp32, last dim
    contiguous) the pages' columns of every row are also overwritten with zeros: the op's output traffic.
    """
    words = cache.view(cache.shape[0], -1).view(torch.int32)
    B, n_pages = table.shape
    page = cache.shape[1]
    grid = (B, triton.cdiv(n_pages, READ_PAGES_PER_PROGRAM))
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=cache.device)
    if logits is None:
        logits, next_n = out.view(1, 1, -1), 0  # no rows written: the pointer is never used
    else:
        if (logits.dtype != torch.float32 or logits.dim() != 3 or logits.shape[0] != B
                or logits.shape[2] < n_pages * page or logits.stride(2) != 1):
            raise ValueError(f"logits: fp32 [B={B}, next_n, >= {n_pages * page}] with a contiguous last dim; "
                             f"got {logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
        next_n = logits.shape[1]
    _read_kv_pages_kernel[grid](
        words, table, out, logits, n_pages, words.stride(0), table.stride(0),
        logits.stride(0), logits.stride(1),
        PAGE_WORDS=words.shape[1], BLOCK=1024, PAGES=READ_PAGES_PER_PROGRAM, PAGE=page, NEXT_N=next_n,
        num_warps=8)
    return out


def torch_ragged_logits(q, kv, w, ks, ke, chunk: int = 8192) -> torch.Tensor:
    """Vectorised torch fallback: bf16 matmul of dequantised q and k, chunked over keys."""
    k, k_scale = kv
    S, H, D = q.shape
    N = k.shape[0]
    qb = q.to(torch.bfloat16).view(S * H, D)
    out = torch.empty(S, N, dtype=torch.float32, device=q.device)
    for n0 in range(0, N, chunk):
        s = (qb @ k[n0:n0 + chunk].to(torch.bfloat16).T).float().relu_().view(S, H, -1)  # [S, H, n]
        out[:, n0:n0 + chunk] = torch.einsum("shn,sh->sn", s, w) * k_scale[n0:n0 + chunk]
    cols = torch.arange(N, device=q.device)[None, :]
    return out.masked_fill_((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))


def torch_paged_logits(q, kv_cache, w, ctx, table, max_ctx, page: int = 64) -> torch.Tensor:
    """Vectorised torch fallback for 1-D ``context_lens``: gather pages, dequantise, bf16 matmul."""
    B, next_n, H, D = q.shape
    P = kv_cache.shape[0]
    flat = kv_cache.view(P, -1)
    vals = flat[:, :page * D].view(P, page, D)
    scales = flat[:, page * D:page * (D + 4)].contiguous().view(torch.float32).view(P, page)
    n_pages = (max_ctx + page - 1) // page
    pages = table[:, :n_pages].long().clamp(min=0)
    k = vals[pages].view(FP8).view(B, n_pages * page, D)[:, :max_ctx].to(torch.bfloat16)  # [B, T, D]
    sc = scales[pages].view(B, -1)[:, :max_ctx]
    s = torch.einsum("bjhd,btd->bjht", q.to(torch.bfloat16), k).float().relu_()
    logits = torch.einsum("bjht,bjh->bjt", s, w.view(B, next_n, H)) * sc[:, None, :]
    pos = ctx[:, None].long() - next_n + torch.arange(next_n, device=q.device)[None, :]  # [B, next_n]
    t = torch.arange(max_ctx, device=q.device)
    logits.masked_fill_(t[None, None, :] > pos[:, :, None], float("-inf"))
    return logits.view(B * next_n, max_ctx)


def _deep_gemm():
    if proxy.active():  # the proxy times the proxied arch's route: natives off
        return None
    try:
        import deep_gemm
    except Exception:
        return None
    return deep_gemm


def ragged_cases(quick: bool) -> list[tuple[int, int, int, int]]:
    lens = (8192,) if quick else (8192, 16384, 32768, 65536)
    return [(4096, n, h, 128) for h in (64, 32) for n in lens]


def paged_cases(quick: bool) -> list[tuple[int, int, int, int, int]]:
    lens = (4096,) if quick else (4096, 8192, 16384, 32768, 65536)
    return [(128, length, next_n, 64, 128) for next_n in (1, 2) for length in lens]


def ragged_inputs(S: int, N: int, H: int, D: int, device: str = "cuda"):
    q = torch.randn(S, H, D, device=device).to(FP8)
    k = torch.randn(N, D, device=device).to(FP8)
    k_scale = torch.rand(N, device=device) * 0.01 + 0.001
    w = torch.randn(S, H, device=device) * H ** -0.5
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=device)
    return q, (k, k_scale), w, ks, ke


def paged_inputs(B: int, L: int, next_n: int, H: int, D: int, page: int = 64, device: str = "cuda"):
    n_pages = L // page
    P = B * n_pages
    cache = torch.empty(P, page, 1, D + 4, dtype=torch.uint8, device=device)
    flat = cache.view(P, -1)
    flat[:, :page * D] = torch.randn(P, page * D, device=device).to(FP8).view(torch.uint8)
    flat[:, page * D:] = (torch.rand(P, page, device=device) * 0.01 + 0.001).view(torch.uint8)
    table = torch.randperm(P, device=device).int().view(B, n_pages)
    ctx = torch.full((B,), L, dtype=torch.int32, device=device)
    q = torch.randn(B, next_n, H, D, device=device).to(FP8)
    w = torch.randn(B * next_n, H, device=device) * H ** -0.5
    return q, cache, w, ctx, table


def _ragged_rows(S: int, N: int, H: int, D: int, fp8_rate: float | None, dg) -> list[dict[str, Any]]:
    shape = {"S": S, "N": N, "H": H, "D": D, "causal": True}
    q, kv, w, ks, ke = ragged_inputs(S, N, H, D)
    flops = 2.0 * H * D * float((ke - ks).clamp(min=0).sum())
    nbytes = S * H * D + N * (D + 4) + S * H * 4 + S * N * 4
    ms, note = _time(lambda: nb.fp8_mqa_logits(q, kv, w, ks, ke, impl="triton"))
    rows = [_row("fp8_mqa_logits", shape, "triton", ms, flops, nbytes, limit=["fp8_tflops"], note=note,
                 vs_fp8_mm=(flops / ms / 1e9 / fp8_rate) if (ms and fp8_rate) else None)]
    baselines = {}
    if N <= 32768:  # the fallback needs S * H * 8192 * 4 bytes of scratch per chunk, and is slow
        baselines["torch"] = lambda: torch_ragged_logits(q, kv, w, ks, ke)
    if dg is not None and H in (32, 64):
        baselines["deep_gemm"] = lambda: dg.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=True)
    rows += _baseline_rows("fp8_mqa_logits", shape, baselines, ms, flops, nbytes)
    return rows


def _vs_read(read_ms: float | None, ms: float | None, name: str = "vs_read_kv") -> dict[str, float]:
    return {name: read_ms / ms} if (read_ms and ms) else {}


def _paged_rows(B: int, L: int, next_n: int, H: int, D: int, copy_rate: float | None,
                dg) -> list[dict[str, Any]]:
    shape = {"B": B, "context": L, "next_n": next_n, "H": H, "D": D, "page": 64}
    q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, num_sms, impl="triton")
    kv_bytes = float(B * L * (D + 4))
    flops = float(paged_logits_flops(B, L, next_n, H, D))
    # Both limits bound the op: the runner adds of_copy, of_fp8_mm and of_roofline.
    both = ["copy_gbps", "fp8_tflops"]
    ms, note = _time(lambda: nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, L, impl="triton"))
    kv_rate = kv_bytes / ms / 1e6 if ms else None
    rows = [_row("fp8_paged_mqa_logits", shape, "triton", ms, flops, kv_bytes, limit=both, note=note,
                 vs_copy=(kv_rate / copy_rate) if (kv_rate and copy_rate) else None)]
    # Decode runs inside CUDA graphs in SGLang and vLLM: the replay time is the served cost.
    g_ms, g_note = _time(lambda: nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, L, impl="triton"), graph=True)
    g_rate = kv_bytes / g_ms / 1e6 if g_ms else None
    # The attainable speed at this size: a pure read of the same pages, plain and graphed.
    r_ms, r_note = _time(lambda: read_kv_pages(cache, table))
    rg_ms, rg_note = _time(lambda: read_kv_pages(cache, table), graph=True)
    # ... and that read plus the op's writes (the logits), the least traffic of the op
    logits = torch.empty(B, next_n, L, dtype=torch.float32, device=cache.device)
    rl_ms, rl_note = _time(lambda: read_kv_pages(cache, table, logits))
    rlg_ms, rlg_note = _time(lambda: read_kv_pages(cache, table, logits), graph=True)
    rows[0]["ratios"].update({**_vs_read(r_ms, ms), **_vs_read(rl_ms, ms, "vs_read_kv_logits")})
    rows.append(_row("fp8_paged_mqa_logits", shape, "triton-graph", g_ms, flops, kv_bytes, limit=both,
                     note=g_note, vs_copy=(g_rate / copy_rate) if (g_rate and copy_rate) else None,
                     **_vs_read(rg_ms, g_ms), **_vs_read(rlg_ms, g_ms, "vs_read_kv_logits")))
    # The kernel alone: every request reads the same HOT_PAGES pages, which stay in L2 (no DRAM traffic).
    hot_table = (torch.arange(table.shape[1], device=table.device, dtype=torch.int32) % HOT_PAGES).expand_as(
        table).contiguous()
    h_ms, h_note = _time(lambda: nb.fp8_paged_mqa_logits(q, cache, w, ctx, hot_table, meta, L, impl="triton"),
                         graph=True)
    rows.append(_row("fp8_paged_mqa_logits", shape, "tile_hot-graph", h_ms, flops, None, limit=["fp8_tflops"],
                     note=h_note))
    for impl, t, n in (("read_kv", r_ms, r_note), ("read_kv-graph", rg_ms, rg_note),
                       ("read_kv_logits", rl_ms, rl_note), ("read_kv_logits-graph", rlg_ms, rlg_note)):
        rate = kv_bytes / t / 1e6 if t else None
        rows.append(_row("fp8_paged_mqa_logits", shape, impl, t, None, kv_bytes, limit=["copy_gbps"], note=n,
                         of_copy=(rate / copy_rate) if (rate and copy_rate) else None))
    baselines = {}
    if L <= 16384:
        baselines["torch"] = lambda: torch_paged_logits(q, cache, w, ctx, table, L)
    if dg is not None:
        dg_meta = dg.get_paged_mqa_logits_metadata(ctx, 64, num_sms)
        baselines["deep_gemm"] = lambda: dg.fp8_paged_mqa_logits(q, cache, w, ctx, table, dg_meta, L, False)
    rows += _baseline_rows("fp8_paged_mqa_logits", shape, baselines, ms, flops, kv_bytes)
    meta_ms, _ = _time(lambda: nb.get_paged_mqa_logits_metadata(ctx, 64, num_sms, impl="triton"))
    rows.append(_row("get_paged_mqa_logits_metadata", {"B": B, "num_sms": num_sms}, "triton", meta_ms))
    return rows


def run(quick: bool, limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """Benchmark rows (see the module docstring). Without CUDA: the built-in tiny reference case."""
    if not torch.cuda.is_available():
        from nsa_backend.bench import builtin

        return builtin.run(FAMILY, quick, limits)
    rows: list[dict[str, Any]] = []
    dg = _deep_gemm()
    for S, N, H, D in ragged_cases(quick):
        rows += _ragged_rows(S, N, H, D, limits.get("fp8_tflops"), dg)
        torch.cuda.empty_cache()
    for B, L, next_n, H, D in paged_cases(quick):
        rows += _paged_rows(B, L, next_n, H, D, limits.get("copy_gbps"), dg)
        torch.cuda.empty_cache()
    return rows


def sweep(quick: bool = False) -> list[dict[str, Any]]:
    """Time candidate launch configurations at one prefill and one decode shape (for tuning the
    tables in ``nsa_backend/configs/indexer.py`` on a new GPU). Rows: ``impl = "triton[config]"``."""
    from nsa_backend.configs.indexer import LogitsConfig
    from nsa_backend.kernels import indexer as ki

    rows: list[dict[str, Any]] = []
    ragged = [LogitsConfig(bn, cols, w, st) for bn, cols, w, st in (
        (128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 8, 3), (64, 256, 4, 3), (64, 128, 4, 4),
        (256, 128, 8, 3))]
    for H in (64, 32):
        S, N, D = 4096, 16384 if quick else 32768, 128
        q, kv, w, ks, ke = ragged_inputs(S, N, H, D)
        flops = 2.0 * H * D * float((ke - ks).clamp(min=0).sum())
        for cfg in ragged:
            if cfg.cols < 16 * ((H + 15) // 16):
                continue
            ms, note = _time(lambda cfg=cfg, a=(q, kv, w, ks, ke):
                             ki.fp8_mqa_logits_triton(*a, True, 0, config=cfg))
            rows.append(_row("fp8_mqa_logits", {"S": S, "N": N, "H": H, "D": D}, f"triton[{cfg}]", ms, flops,
                             note=note))
    for next_n in (1, 2):
        B, L, H, D = 128, 16384 if quick else 32768, 64, 128
        q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D)
        kv_bytes = float(B * L * (D + 4))
        flops = float(paged_logits_flops(B, L, next_n, H, D))
        cols = 64 * next_n
        for bn, warps, st, ahead in ((64, 4, 6, True), (64, 4, 6, False), (64, 4, 4, True), (64, 4, 8, True),
                                     (128, 4, 6, True), (64, 8, 6, True)):
            for chunk in (512, 1024, 2048, 4096):
                if chunk % bn:
                    continue
                cfg = LogitsConfig(bn, cols, warps, st, ahead)
                ms, note = _time(lambda cfg=cfg, chunk=chunk, a=(q, cache, w, ctx, table, None, L):
                                 ki.fp8_paged_mqa_logits_triton(*a, config=cfg, chunk=chunk))
                rows.append(_row("fp8_paged_mqa_logits", {"B": B, "context": L, "next_n": next_n, "H": H},
                                 f"triton[{cfg}, chunk={chunk}]", ms, flops, kv_bytes, note=note))
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m nsa_backend.bench.indexer [--quick] [--sweep] [--out PREFIX]``: JSON + markdown."""
    from nsa_backend.bench.standalone import family_main

    family_main(__spec__.name if __spec__ else "nsa_backend.bench.indexer", run, sweep, argv)


if __name__ == "__main__":
    main()
