"""Benchmark of the DeepSeek-V4 ops besides the attention (the ``v4`` family): the MXFP4 indexer logits
and the 584-byte KV-cache write.

Shapes (full mode; quick mode keeps the first of each):

- ``fp8_fp4_paged_mqa_logits`` (decode): ``B = 128`` requests of ``L`` in {8K, 32K} tokens, ``next_n`` in
  {1, 2}, ``H = 64`` indexer heads, ``D = 128``, e4m3 queries, MXFP4 key pages of 64 tokens (68 bytes per
  token) in random order. The rate is the bytes of the key cache read (``B * L * 68``) per second,
  ``of_copy`` divides it by the copy bandwidth of the same run. Rows ``triton`` (eager) and
  ``triton-graph`` (CUDA-graph replay, how servers run decode); ``deep_gemm`` when that package imports
  (natively, not under the proxy).
- ``fp8_fp4_mqa_logits`` (prefill): ``S = 4096`` causal queries at the end of ``N`` in {8K, 32K} MXFP4
  keys, ``H = 64``, ``D = 128``, e4m3 queries. Useful FLOPs ``2 * H * D * (valid pairs)``; ``of_fp8_mm``
  divides the rate by the fp8 matmul rate of the same run (the keys are widened from e2m1 in software,
  so a kernel runs at an fp8 MMA rate at best).
- ``write_fp8_ds_mla_v4_cache``: ``T`` in {128 (a decode step), 16384 (a prefill chunk)} tokens with
  the RMSNorm and the rope, into 256-token pages at random slots. Bytes: ``T * (1024 + 584)`` (the bf16
  rows read, the cache rows written); ``of_copy`` as above. ``T = 128`` is also timed as a graph replay.

The DeepSeek-V4 sparse MLA decode is timed by the ``peers`` family, next to FlashMLA's and SGLang's.
Without CUDA the family runs one tiny case of each op through the reference (the harness stays exercised).
"""

from __future__ import annotations

from typing import Any

import torch

import nsa_backend as nb
from nsa_backend import reference as ref
from nsa_backend.bench import proxy
from nsa_backend.bench.roofline import paged_logits_flops
from nsa_backend.bench.timing import bench_ms, gbps, tflops

FAMILY = "v4"
FP8 = torch.float8_e4m3fn
WARMUP_MS, REP_MS = 10.0, 40.0
HEAD_DIM = 128
FP4_TOKEN_BYTES = 68
KV_PAGE = 64
V4_PAGE = 256


def _row(op: str, shape: dict[str, Any], impl: str, ms: float | None, flops: float | None = None,
         nbytes: float | None = None, *, limit: list[str] | None = None, note: str | None = None,
         **ratios: float | None) -> dict[str, Any]:
    row = {"family": FAMILY, "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": tflops(flops, ms),
           "gbps": gbps(nbytes, ms), "ratios": {k: v for k, v in ratios.items() if v is not None}}
    if limit:
        row["limit"] = limit
    if note:
        row["note"] = note
    return row


def _time(fn, device: torch.device, graph: bool = False) -> tuple[float | None, str | None]:
    try:
        return bench_ms(fn, WARMUP_MS, REP_MS, graph=graph, device=device), None
    except Exception as exc:  # a failing implementation is reported, the others still run
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def _deep_gemm():
    if proxy.active():  # the proxy times the proxied arch's route: natives off
        return None
    try:
        import deep_gemm
    except Exception:
        return None
    return deep_gemm


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def paged_fp4_inputs(B: int, L: int, next_n: int, H: int, device: torch.device) -> dict[str, Any]:
    """e4m3 ``q [B, next_n, H, 128]``, an MXFP4 key cache of ``B * L / 64`` pages in random order,
    weights, ``context_lens [B] = L`` and the block table."""
    n_pages = L // KV_PAGE
    P = B * n_pages
    cache = torch.empty(P, KV_PAGE, 1, FP4_TOKEN_BYTES, dtype=torch.uint8, device=device)
    for p0 in range(0, P, 4096):  # bounded temporaries for the largest caches
        p1 = min(P, p0 + 4096)
        keys = torch.randn((p1 - p0) * KV_PAGE, HEAD_DIM, device=device)
        cache[p0:p1] = nb.pack_indexer_k_cache_fp4(keys, KV_PAGE).view(p1 - p0, KV_PAGE, 1, FP4_TOKEN_BYTES)
    return dict(q=torch.randn(B, next_n, H, HEAD_DIM, device=device).to(FP8), cache=cache,
                w=torch.randn(B * next_n, H, device=device) * H ** -0.5,
                ctx=torch.full((B,), L, dtype=torch.int32, device=device),
                table=torch.randperm(P, device=device).int().view(B, n_pages))


def ragged_fp4_inputs(S: int, N: int, H: int, device: torch.device) -> dict[str, Any]:
    """e4m3 ``q [S, H, 128]``, MXFP4 keys ``[N, 64]`` with ``int32`` scales, causal bounds."""
    k, k_scale = ref.quantize_mxfp4(torch.randn(N, HEAD_DIM, device=device))
    return dict(q=torch.randn(S, H, HEAD_DIM, device=device).to(FP8), kv=(k, k_scale.view(torch.int32).view(N)),
                w=torch.randn(S, H, device=device) * H ** -0.5,
                ks=torch.zeros(S, dtype=torch.int32, device=device),
                ke=torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=device))


def write_inputs(T: int, device: torch.device) -> dict[str, Any]:
    """``T`` bf16 rows, a norm weight, rope positions and table, a 256-token page cache and random slots."""
    pages = -(-2 * T // V4_PAGE)
    theta = torch.arange(4096, device=device)[:, None] * (10000.0 ** (-torch.arange(32, device=device) / 32.0))
    return dict(kv=torch.randn(T, 512, device=device).bfloat16(),
                cache=torch.zeros(pages, V4_PAGE, 1, 584, dtype=torch.uint8, device=device),
                slots=torch.randperm(pages * V4_PAGE, device=device)[:T],
                w=torch.rand(512, device=device) + 0.5,
                pos=torch.randint(0, 4096, (T,), device=device),
                cs=torch.cat([theta.cos(), theta.sin()], dim=1))


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------

def _paged_rows(B: int, L: int, next_n: int, H: int, device: torch.device, dg) -> list[dict[str, Any]]:
    op = "fp8_fp4_paged_mqa_logits"
    shape = {"B": B, "context": L, "next_n": next_n, "H": H, "D": HEAD_DIM, "page": KV_PAGE}
    a = paged_fp4_inputs(B, L, next_n, H, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    meta = nb.get_paged_mqa_logits_metadata(a["ctx"], KV_PAGE, sms)
    nbytes = float(B * L * FP4_TOKEN_BYTES)
    # Bounded by the copy rate and, at 64 heads, by the fp8 matmul rate: the runner adds of_roofline.
    flops = float(paged_logits_flops(B, L, next_n, H, HEAD_DIM))
    both = ["copy_gbps", "fp8_tflops"]

    def call(impl: str):
        return lambda: nb.fp8_fp4_paged_mqa_logits(a["q"], a["cache"], a["w"], a["ctx"], a["table"], meta, L,
                                                   impl=impl)

    impls = ["triton"] if device.type == "cuda" else ["reference"]
    rows = []
    for impl in impls:
        for graph in ((False, True) if device.type == "cuda" else (False,)):
            ms, note = _time(call(impl), device, graph)
            rows.append(_row(op, shape, impl + ("-graph" if graph else ""), ms, flops, nbytes, limit=both,
                             note=note))
    if dg is not None and hasattr(dg, op):
        dg_meta = dg.get_paged_mqa_logits_metadata(a["ctx"], KV_PAGE, sms)
        ms, note = _time(lambda: nb.fp8_fp4_paged_mqa_logits(a["q"], a["cache"], a["w"], a["ctx"], a["table"],
                                                             dg_meta, L, impl="deep_gemm"), device, True)
        rows.append(_row(op, shape, "deep_gemm-graph", ms, flops, nbytes, limit=both, note=note))
    return rows


def _ragged_rows(S: int, N: int, H: int, device: torch.device, dg) -> list[dict[str, Any]]:
    op = "fp8_fp4_mqa_logits"
    shape = {"S": S, "N": N, "H": H, "D": HEAD_DIM, "causal": True}
    a = ragged_fp4_inputs(S, N, H, device)
    flops = 2.0 * H * HEAD_DIM * float((a["ke"] - a["ks"]).clamp(min=0).sum())
    impls = ["triton"] if device.type == "cuda" else ["reference"]
    if dg is not None and hasattr(dg, op):
        impls.append("deep_gemm")
    rows = []
    for impl in impls:
        ms, note = _time(lambda impl=impl: nb.fp8_fp4_mqa_logits(a["q"], a["kv"], a["w"], a["ks"], a["ke"],
                                                                 impl=impl), device)
        rows.append(_row(op, shape, impl, ms, flops, None, limit=["fp8_tflops"], note=note))
    return rows


def _write_rows(T: int, device: torch.device) -> list[dict[str, Any]]:
    op = "write_fp8_ds_mla_v4_cache"
    shape = {"tokens": T, "page": V4_PAGE, "norm": True, "rope": True}
    a = write_inputs(T, device)
    nbytes = float(T * (512 * 2 + 584))
    impl = "triton" if device.type == "cuda" else "reference"
    rows = []
    for graph in ((False, True) if device.type == "cuda" and T <= 1024 else (False,)):
        ms, note = _time(lambda: nb.write_fp8_ds_mla_v4_cache(a["kv"], a["cache"], a["slots"], a["w"], a["pos"],
                                                             a["cs"], impl=impl), device, graph)
        rows.append(_row(op, shape, impl + ("-graph" if graph else ""), ms, None, nbytes, limit=["copy_gbps"],
                         note=note))
    return rows


def run(quick: bool, limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """Benchmark rows (see the module docstring); the runner adds the ratios to the limits."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dg = _deep_gemm() if cuda else None
    if not cuda:  # one tiny case per op through the reference
        return _paged_rows(2, 128, 1, 8, device, None) + _ragged_rows(16, 64, 8, device, None) + _write_rows(16, device)
    rows: list[dict[str, Any]] = []
    for next_n in (1, 2):
        for L in ((8192,) if quick else (8192, 32768)):
            rows += _paged_rows(128, L, next_n, 64, device, dg)
            torch.cuda.empty_cache()
    for N in ((8192,) if quick else (8192, 32768)):
        rows += _ragged_rows(4096, N, 64, device, dg)
        torch.cuda.empty_cache()
    for T in ((128,) if quick else (128, 16384)):
        rows += _write_rows(T, device)
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m nsa_backend.bench.v4 [--quick] [--out PREFIX]``: JSON + markdown."""
    from nsa_backend.bench.standalone import family_main

    family_main(__spec__.name if __spec__ else "nsa_backend.bench.v4", run, None, argv)


if __name__ == "__main__":
    main()
