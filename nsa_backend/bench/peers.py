"""Benchmark of our kernels next to SGLang's own SM120 fallbacks (the ``peers`` family).

For ``nsa-backend bench --proxy sm120`` on a Hopper GPU (routing forced to sm120, ``tl.dot`` on
mma.sync): what an SM120 server gets from SGLang without DeepGEMM / FlashMLA, timed against our
Triton kernels on the same inputs. The peers are loaded from the sglang package tree by
:mod:`nsa_backend.bench.peers_sglang` (``NSA_BACKEND_BENCH_SGLANG_ROOT=<dir holding sglang/>``, or the
installed ``sglang``), never imported; without one, every peer row says so in its ``note``.

Shapes (full mode; ``quick`` keeps the first of each, and without CUDA tiny shapes run in the
interpreter):

- ``sparse_mla_decode`` over DeepSeek-V4's 584-byte cache: ``B = 128``, ``s_q = 1``, ``h_q`` in
  {64, 128}, a 128-token sliding window in the SWA cache (page 256) plus ``topk = 512`` slots of the
  compressed (``extra``) cache (page 64, ``context / 4`` tokens per request), ``context`` in
  {8K, 16K, 32K, 64K}. Ours: ``sparse_mla_decode(kv_format="fp8_ds_mla_v4", impl="triton")``; peers
  ``sglang_sm120_triton`` and ``sglang_sm120_torch``, and FlashMLA (``flash_mla``, our native route) where
  the GPU and the installed package serve it (not under the proxy); all timed as CUDA-graph replays (``*-graph``),
  how servers run decode. Bytes: the gathered tokens, ``q`` and ``out``.
- ``sparse_mla_decode`` over the 656-byte DeepSeek-V3.2 cache: no peer exists in the sglang package
  (SGLang decodes it on SM120 with FlashInfer's CUTLASS kernel); one note row says so.
- ``fp8_paged_mqa_logits``: ``B = 128``, ``context`` in {8K, 16K, 32K, 64K}, ``H`` in {64, 32},
  ``next_n`` in {1, 2}, ``D = 128``, page 64, pages in random order; peers ``sglang_torch_sm120`` and
  ``sglang_torch`` (``next_n = 1`` only: SGLang's torch path asserts it; ``next_n = 2`` gets note rows).
  Graph replays. Bytes: the cache read.
- ``fp8_mqa_logits``: ``S = 4096`` causal queries over ``N`` in {8K, 32K} keys, ``H`` in {64, 32};
  peer ``sglang_torch``. Eager.

Inputs are the same tensors for both sides: caches written with our public ops
(``write_fp8_ds_mla_v4_cache``, ``pack_indexer_k_cache``), whose bytes are SGLang's layouts as they
are, passed through the adapters of :mod:`nsa_backend.bench.peers_sglang`. Before timing, each peer's
output is compared once with ours (nan-safe, inside the valid region): the row records ``max_err``
(max abs difference), ``tol``, ``err_vs_tol`` (the worst difference over its bound) and ``match``; a
peer outside the tolerance is not timed (``ms`` None, the note says why), so no speed ratio stands on a
wrong result. Tolerances follow the ops' tests:
decode ``|d| <= 1.6e-2 + 1.6e-2 |ours|`` on ``out`` and ``1e-4 + 1e-4 |ours|`` on ``lse``; indexer
logits ``|d| <= 1e-2 * max |ours| + 1e-6`` over the valid entries: the ops' tests use ``2e-3``, widened
because SGLang's torch code rounds every head's ``q.k`` to bf16 before the weighted sum (a bf16 step is
2^-8 of the value).

Run alone: ``python -m nsa_backend.bench.peers [--quick] [--out PREFIX]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import nsa_backend as nb
from nsa_backend.bench import peers_sglang as sg
from nsa_backend.bench.roofline import paged_logits_flops
from nsa_backend.bench.timing import bench_ms, gbps, tflops

FAMILY = "peers"
FP8 = torch.float8_e4m3fn
WARMUP_MS, REP_MS = 10.0, 40.0
# V4 decode: SWA pages of 256 tokens (SGLang's SWA pool), compressed pages of 64, c4 compression.
V4_SWA_PAGE, V4_EXTRA_PAGE, V4_COMPRESS = 256, 64, 4
V4_WINDOW, V4_TOPK = 128, 512
V4_TOKEN_BYTES = 584
INDEXER_PAGE = 64
# Tolerances (see the module docstring).
DECODE_OUT_TOL, DECODE_LSE_TOL = 1.6e-2, 1e-4
LOGITS_REL_TOL = 1e-2

Row = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Rows, timing and the comparison
# ----------------------------------------------------------------------------------------------

def _row(op: str, shape: dict[str, Any], impl: str, ms: float | None, flops: float | None = None,
         nbytes: float | None = None, *, note: str | None = None, **extra: Any) -> Row:
    row: Row = {"family": FAMILY, "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": tflops(flops, ms),
                "gbps": gbps(nbytes, ms), "ratios": {}}
    if note:
        row["note"] = note
    row.update(extra)
    return row


def _time(fn: Callable[[], Any], graph: bool) -> tuple[float | None, str | None]:
    on_cuda = torch.cuda.is_available()
    try:
        return bench_ms(fn, WARMUP_MS if on_cuda else 0.0, REP_MS if on_cuda else 0.0,
                        graph=graph and on_cuda), None
    except Exception as exc:  # a failing implementation is reported, the others still run
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def max_abs_err(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Largest ``|got - want|`` over ``mask`` (all when None), NaN-safe: a NaN or infinity on one side
    only counts as ``inf``; equal infinities and NaN on both sides count as 0."""
    g, w = got.float(), want.float()
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    d = torch.where(same, torch.zeros_like(g), (g - w).abs())
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    if mask is not None:
        d = d[mask]
    return float(d.max()) if d.numel() else 0.0


def _tol_ratio(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    """Largest ``|got - want| / (atol + rtol * |want|)`` (NaN-safe as :func:`max_abs_err`); ``<= 1`` passes."""
    g, w = got.float(), want.float()
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    bound = atol + rtol * w.abs().nan_to_num(posinf=0.0, neginf=0.0)
    d = torch.where(same, torch.zeros_like(g), (g - w).abs() / bound)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max()) if d.numel() else 0.0


Check = dict[str, Any]


def compare_decode(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> Check:
    """A peer's decode ``(out, lse)`` against ours: ``max_err`` (max abs difference of ``out``),
    ``err_vs_tol`` (the largest difference over its bound, ``out`` and ``lse`` together), ``tol`` (the
    bounds, the V4 decode tests' tolerances) and ``match`` (``err_vs_tol <= 1``)."""
    (out, lse), (w_out, w_lse) = got, want
    tol = (f"out {DECODE_OUT_TOL:g} + {DECODE_OUT_TOL:g}|ours|, lse {DECODE_LSE_TOL:g} + {DECODE_LSE_TOL:g}|ours|")
    if out.shape != w_out.shape or lse.shape != w_lse.shape:
        return {"max_err": math.inf, "err_vs_tol": math.inf, "tol": tol, "match": False}
    ratio = max(_tol_ratio(out, w_out, DECODE_OUT_TOL, DECODE_OUT_TOL),
                _tol_ratio(lse, w_lse, DECODE_LSE_TOL, DECODE_LSE_TOL))
    return {"max_err": max_abs_err(out, w_out), "err_vs_tol": ratio, "tol": tol, "match": ratio <= 1.0}


def compare_logits(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> Check:
    """Indexer logits inside ``valid`` (``[rows, cols]`` bool) against ours: ``max_err``, ``tol`` =
    ``1e-2 * max |ours| + 1e-6`` over the valid entries, ``err_vs_tol`` and ``match``."""
    if got.shape != want.shape:
        return {"max_err": math.inf, "err_vs_tol": math.inf, "tol": "shape", "match": False}
    inside = want.float()[valid]
    scale = float(inside.abs().max()) if inside.numel() else 0.0
    tol = LOGITS_REL_TOL * scale + 1e-6
    err = max_abs_err(got, want, valid)
    return {"max_err": err, "err_vs_tol": err / tol, "tol": f"{tol:.3g}", "match": err <= tol}


def _peer_row(op: str, shape: dict[str, Any], impl: str, source: str, run_peer: Callable[[], Any],
              check: Callable[[Any], Check], graph: bool, flops: float | None, nbytes: float | None) -> Row:
    """Run the peer once, compare with ours, then time it (only when it matches)."""
    name = impl + ("-graph" if graph else "")
    try:
        got = run_peer()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:
        return _row(op, shape, name, None, note=f"{source} failed: {type(exc).__name__}: {str(exc)[:200]}")
    result = check(got)
    del got
    said = f"max_err {result['max_err']:.3g}, {result['err_vs_tol']:.2f} of tol ({result['tol']})"
    if not result["match"]:
        return _row(op, shape, name, None, note=f"{source}: output differs from ours ({said}); not timed", **result)
    ms, note = _time(run_peer, graph)
    return _row(op, shape, name, ms, flops, nbytes, note=note or f"{source}; matches ours: {said}", **result)


def _load(loader: Callable[[], Any]) -> tuple[Any | None, str | None]:
    try:
        return loader(), None
    except sg.PeerUnavailable as exc:
        return None, f"skipped: {exc}"


def _skip_rows(op: str, shape: dict[str, Any], impls: list[str], note: str) -> list[Row]:
    return [_row(op, shape, impl, None, note=note) for impl in impls]


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4 sparse MLA decode
# ----------------------------------------------------------------------------------------------

def v4_decode_inputs(B: int, h_q: int, context: int, window: int, topk: int, device: torch.device,
                     swa_page: int = V4_SWA_PAGE, extra_page: int = V4_EXTRA_PAGE) -> dict[str, Any]:
    """Our V4 decode arguments: an SWA cache holding each request's last ``window`` tokens (two pages
    per request, the window starting at a random offset of the first) and a compressed cache of
    ``context // 4`` tokens per request on pages in random order, ``topk`` distinct slots of it per request;
    both written with :func:`nsa_backend.write_fp8_ds_mla_v4_cache`."""
    g = torch.Generator(device="cpu").manual_seed(0)
    swa_pages = 2 * B
    swa = torch.zeros(swa_pages, swa_page, 1, V4_TOKEN_BYTES, dtype=torch.uint8, device=device)
    kv = (torch.randn(swa_pages * swa_page, 512, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
    nb.write_fp8_ds_mla_v4_cache(kv, swa, torch.arange(swa_pages * swa_page, device=device))
    start = torch.randint(0, swa_page, (B, 1), generator=g) + torch.arange(B)[:, None] * 2 * swa_page
    swa_idx = (start + torch.arange(window)[None, :]).to(torch.int32).view(B, 1, window).to(device)

    n_comp = max(context // V4_COMPRESS, topk)
    per_req = -(-n_comp // extra_page)
    extra_pages = B * per_req
    extra = torch.zeros(extra_pages, extra_page, 1, V4_TOKEN_BYTES, dtype=torch.uint8, device=device)
    for p0 in range(0, extra_pages, 4096):  # bounded temporaries for the largest caches
        p1 = min(extra_pages, p0 + 4096)
        kv = (torch.randn((p1 - p0) * extra_page, 512, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
        slots = torch.arange(p0 * extra_page, p1 * extra_page, device=device)
        nb.write_fp8_ds_mla_v4_cache(kv, extra, slots)
    del kv
    table = torch.randperm(extra_pages, generator=g).view(B, per_req)
    pos = torch.rand(B, n_comp, generator=g).argsort(dim=1)[:, :topk]
    extra_idx = (torch.gather(table, 1, pos // extra_page) * extra_page + pos % extra_page)
    extra_idx = extra_idx.to(torch.int32).view(B, 1, topk).to(device)
    q = torch.randn(B, 1, h_q, 512, generator=g).to(device=device, dtype=torch.bfloat16)
    return dict(q=q, kv_cache=swa, indices=swa_idx, topk_length=torch.full((B,), window, dtype=torch.int32,
                                                                            device=device),
                extra_kv_cache=extra, extra_indices=extra_idx,
                extra_topk_length=torch.full((B,), topk, dtype=torch.int32, device=device), sm_scale=512 ** -0.5)


def _ours_v4(a: dict[str, Any], impl: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    return nb.sparse_mla_decode(a["q"], a["kv_cache"], a["indices"], a["sm_scale"], 512, "fp8_ds_mla_v4", None,
                                a["topk_length"], extra_kv_cache=a["extra_kv_cache"],
                                extra_indices=a["extra_indices"], extra_topk_length=a["extra_topk_length"],
                                impl=impl)


def _flash_mla_v4_row(a: dict[str, Any], shape: dict[str, Any], want: tuple[torch.Tensor, torch.Tensor],
                      graph: bool, flops: float, nbytes: float) -> Row:
    """FlashMLA's DeepSeek-V4 decode through our native route (``impl="flash_mla"``) on the same inputs,
    where the GPU and the installed package serve it (natively, not under the proxy)."""
    try:
        nb.sparse_mla_decode(a["q"][:1], a["kv_cache"], a["indices"][:1], a["sm_scale"], 512, "fp8_ds_mla_v4",
                             None, a["topk_length"][:1], extra_kv_cache=a["extra_kv_cache"],
                             extra_indices=a["extra_indices"][:1], extra_topk_length=a["extra_topk_length"][:1],
                             impl="flash_mla")
    except (ValueError, ImportError, RuntimeError) as exc:
        return _row("sparse_mla_decode", shape, "flash_mla", None, note=f"skipped: {str(exc)[:200]}")
    return _peer_row("sparse_mla_decode", shape, "flash_mla", "FlashMLA (nsa-backend's native route)",
                     lambda: _ours_v4(a, "flash_mla"), lambda got: compare_decode(got, want), graph, flops, nbytes)


def bench_v4_decode(tree: sg.SglangTree, B: int, h_q: int, context: int, window: int, topk: int,
                    device: torch.device) -> list[Row]:
    a = v4_decode_inputs(B, h_q, context, window, topk, device)
    shape = {"B": B, "s_q": 1, "h_q": h_q, "context": context, "window": window, "topk": topk,
             "kv_format": "fp8_ds_mla_v4"}
    keys = window + topk
    flops = 2.0 * B * h_q * keys * (512 + 512)
    nbytes = B * keys * float(V4_TOKEN_BYTES) + a["q"].numel() * 2 + B * h_q * 512 * 2
    graph = device.type == "cuda"
    want = _ours_v4(a)
    ms, note = _time(lambda: _ours_v4(a), graph)
    rows = [_row("sparse_mla_decode", shape, "triton-graph" if graph else "triton", ms, flops, nbytes, note=note)]
    args = (a["q"], a["kv_cache"], a["indices"], a["topk_length"], a["extra_kv_cache"], a["extra_indices"],
            a["extra_topk_length"], a["sm_scale"])
    rows.append(_flash_mla_v4_row(a, shape, want, graph, flops, nbytes))
    for impl, loader in (("sglang_sm120_triton", sg.v4_decode_triton), ("sglang_sm120_torch", sg.v4_decode_torch)):
        source = sg.PEERS[("sparse_mla_decode", impl)]
        fn, why = _load(lambda loader=loader: loader(tree))
        if fn is None:
            rows.append(_row("sparse_mla_decode", shape, impl, None, note=why))
            continue
        rows.append(_peer_row("sparse_mla_decode", shape, impl, source, lambda fn=fn: fn(*args),
                              lambda got: compare_decode(got, want), graph, flops, nbytes))
    return rows


def v32_decode_note() -> Row:
    """The 656-byte cache: no peer in the sglang package (one note row)."""
    return _row("sparse_mla_decode", {"kv_format": "fp8_ds_mla", "topk": 2048}, "sglang_sm120", None,
                note="no peer: SGLang decodes the 656-byte cache on SM120 with FlashInfer's CUTLASS kernel "
                     "(flashinfer_sparse_mla), outside the sglang package; its Triton triton_sparse_mla is a "
                     "prefill over a dequantised bf16 cache")


# ----------------------------------------------------------------------------------------------
# Indexer logits
# ----------------------------------------------------------------------------------------------

def paged_inputs(B: int, L: int, next_n: int, H: int, D: int, device: torch.device) -> dict[str, Any]:
    """``fp8_paged_mqa_logits`` arguments: keys packed with :func:`nsa_backend.pack_indexer_k_cache`,
    pages in random order."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n_pages = -(-L // INDEXER_PAGE)
    P = B * n_pages
    k = torch.randn(P * INDEXER_PAGE, D, generator=g).to(device=device, dtype=torch.bfloat16)
    cache = nb.pack_indexer_k_cache(k, INDEXER_PAGE)
    del k
    table = torch.randperm(P, generator=g).to(torch.int32).view(B, n_pages).to(device)
    q = torch.randn(B, next_n, H, D, generator=g).to(device).to(FP8)
    w = (torch.randn(B * next_n, H, generator=g) * H ** -0.5).to(device)
    ctx = torch.full((B,), L, dtype=torch.int32, device=device)
    return dict(q=q, kv_cache=cache, weights=w, context_lens=ctx, block_table=table, max_context_len=L)


def bench_paged(tree: sg.SglangTree, B: int, L: int, next_n: int, H: int, D: int, device: torch.device) -> list[Row]:
    op = "fp8_paged_mqa_logits"
    shape = {"B": B, "context": L, "next_n": next_n, "H": H, "D": D, "page": INDEXER_PAGE}
    impls = ["sglang_torch_sm120", "sglang_torch"]
    if next_n != 1:
        return _skip_rows(op, shape, impls, "skipped: SGLang's torch paged logits take next_n = 1 only "
                                            "(its wrapper asserts it: speculative decoding off)")
    a = paged_inputs(B, L, next_n, H, D, device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    meta = nb.get_paged_mqa_logits_metadata(a["context_lens"], INDEXER_PAGE, num_sms)

    def ours() -> torch.Tensor:
        return nb.fp8_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                                       meta, L, impl="triton")

    nbytes = float(B * L * (D + 4))
    flops = float(paged_logits_flops(B, L, next_n, H, D))
    graph = device.type == "cuda"
    want = ours()
    ms, note = _time(ours, graph)
    rows = [_row(op, shape, "triton-graph" if graph else "triton", ms, flops, nbytes, note=note)]
    # row b (next_n = 1) sees keys [0, L)
    valid = torch.arange(L, device=device)[None, :] < a["context_lens"][:, None]
    for impl in impls:
        fn, why = _load(lambda impl=impl: sg.paged_logits(tree, impl))
        if fn is None:
            rows.append(_row(op, shape, impl, None, note=why))
            continue
        rows.append(_peer_row(
            op, shape, impl, sg.PEERS[(op, impl)],
            lambda fn=fn: fn(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], L),
            lambda got: compare_logits(got, want, valid), graph, flops, nbytes))
    return rows


def ragged_inputs(S: int, N: int, H: int, D: int, device: torch.device) -> dict[str, Any]:
    """``fp8_mqa_logits`` arguments: ``S`` causal queries at the end of ``N`` keys (row ``i`` sees
    ``[0, N - S + i]``)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(S, H, D, generator=g).to(device).to(FP8)
    k = torch.randn(N, D, generator=g).to(device).to(FP8)
    k_scale = (torch.rand(N, generator=g) * 0.01 + 0.001).to(device)
    w = (torch.randn(S, H, generator=g) * H ** -0.5).to(device)
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=device)
    return dict(q=q, kv=(k, k_scale), weights=w, ks=ks, ke=ke)


def bench_ragged(tree: sg.SglangTree, S: int, N: int, H: int, D: int, device: torch.device) -> list[Row]:
    op = "fp8_mqa_logits"
    shape = {"S": S, "N": N, "H": H, "D": D, "causal": True}
    a = ragged_inputs(S, N, H, D, device)

    def ours() -> torch.Tensor:
        return nb.fp8_mqa_logits(a["q"], a["kv"], a["weights"], a["ks"], a["ke"], impl="triton")

    flops = 2.0 * H * D * float((a["ke"] - a["ks"]).clamp(min=0).sum())
    nbytes = S * H * D + N * (D + 4) + S * H * 4 + S * N * 4
    want = ours()
    ms, note = _time(ours, False)
    rows = [_row(op, shape, "triton", ms, flops, nbytes, note=note)]
    cols = torch.arange(N, device=device)[None, :]
    valid = (cols >= a["ks"][:, None]) & (cols < a["ke"][:, None])
    fn, why = _load(lambda: sg.ragged_logits(tree))
    if fn is None:
        rows.append(_row(op, shape, "sglang_torch", None, note=why))
    else:
        rows.append(_peer_row(op, shape, "sglang_torch", sg.PEERS[(op, "sglang_torch")],
                              lambda: fn(a["q"], a["kv"], a["weights"], a["ks"], a["ke"]),
                              lambda got: compare_logits(got, want, valid), False, flops, nbytes))
    return rows


# ----------------------------------------------------------------------------------------------
# The family
# ----------------------------------------------------------------------------------------------

def cases(quick: bool, on_cuda: bool) -> dict[str, list[tuple[int, ...]]]:
    """Shapes per op: ``v4`` ``(B, h_q, context, window, topk)``, ``paged`` ``(B, L, next_n, H, D)``,
    ``ragged`` ``(S, N, H, D)``."""
    if not on_cuda:  # the interpreter: tiny shapes
        return {"v4": [(2, 16, 256, 8, 16)], "paged": [(2, 128, 1, 16, 128), (2, 128, 2, 16, 128)],
                "ragged": [(4, 64, 16, 128)]}
    if quick:
        return {"v4": [(32, 64, 8192, V4_WINDOW, V4_TOPK)],
                "paged": [(32, 4096, 1, 64, 128), (32, 4096, 2, 64, 128)], "ragged": [(1024, 8192, 64, 128)]}
    contexts = (8192, 16384, 32768, 65536)
    return {"v4": [(128, h, c, V4_WINDOW, V4_TOPK) for h in (64, 128) for c in contexts],
            "paged": [(128, c, n, h, 128) for h in (64, 32) for n in (1, 2) for c in contexts],
            "ragged": [(4096, n, h, 128) for h in (64, 32) for n in (8192, 32768)]}


def missing_rows(why: str) -> list[Row]:
    """One note row per peer when no sglang tree is available."""
    return [_row(op, {}, impl, None, note=f"skipped: {why}") for op, impl in sg.PEERS] + [v32_decode_note()]


def run(quick: bool, limits: dict[str, float | None]) -> list[Row]:
    """Benchmark rows (see the module docstring); ``limits`` is unused (the runner adds the ratios)."""
    tree = sg.find_sglang_root()
    if tree is None:
        return missing_rows(f"no sglang package: install sglang or set {sg.SGLANG_ROOT_ENV}=<dir containing "
                            "the sglang/ package>")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = cases(quick, device.type == "cuda")
    rows: list[Row] = []
    for B, h_q, context, window, topk in shapes["v4"]:
        rows += bench_v4_decode(tree, B, h_q, context, window, topk, device)
        _free(device)
    rows.append(v32_decode_note())
    for B, L, next_n, H, D in shapes["paged"]:
        rows += bench_paged(tree, B, L, next_n, H, D, device)
        _free(device)
    for S, N, H, D in shapes["ragged"]:
        rows += bench_ragged(tree, S, N, H, D, device)
        _free(device)
    origin = f"sglang {tree.version or '(version unknown)'} from {tree.root} ({tree.origin})"
    for row in rows:
        if row["impl"].startswith("sglang"):
            row["peer_source"] = origin
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    """``python -m nsa_backend.bench.peers [--quick] [--out PREFIX]``: JSON + markdown."""
    from nsa_backend.bench.standalone import family_main

    family_main(__spec__.name if __spec__ else "nsa_backend.bench.peers", run, None, argv)


if __name__ == "__main__":
    main()
