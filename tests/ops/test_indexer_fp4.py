"""Indexer logits over an MXFP4 key cache (DeepSeek-V4): references, Triton kernels, packing.

- References against a naive implementation written here (bit-by-bit e2m1 / UE8M0 decoding, a
  dense matmul, relu, weights, head sum and the window / context masks).
- Triton kernels against the references in the interpreter (``TRITON_INTERPRET=1``): e4m3 and MXFP4
  queries, head counts 1, 7, 32, 64, compressed output, next_n 1 and 2, both ``context_lens``
  forms, page sizes 32 and 64, a padded page stride and invalid block-table entries.
- Packing: round trip within the e2m1 bound, nibble order, scale bytes and page layout.
- Bad inputs raise before any kernel runs; an ahead-of-time compile for sm_80 .. sm_121; GPU fuzz.
"""

from __future__ import annotations

import os
import random
import textwrap

import pytest
import torch

import nsa_backend as nb
from nsa_backend import reference as ref
from tests.ops._aot import assert_rows_fit, run_aot_script

FP8 = torch.float8_e4m3fn
D = 128
pytest.importorskip("triton")


# ----------------------------------------------------------------------------------------------
# Naive decoding and logits (independent of nsa_backend.reference)
# ----------------------------------------------------------------------------------------------

def _naive_e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def _naive_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, D/2] bytes and [R, D/32] UE8M0 bytes -> float64 [R, D], one value at a time through a table."""
    table = torch.tensor([_naive_e2m1(c) for c in range(16)], dtype=torch.float64)
    p = packed.reshape(-1, packed.shape[-1]).long()
    out = torch.empty(p.shape[0], 2 * p.shape[1], dtype=torch.float64)
    out[:, 0::2] = table[p & 15]
    out[:, 1::2] = table[p >> 4]
    sc = scales.reshape(p.shape[0], -1).long()
    factor = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float64)[sc]
    return out * factor.repeat_interleave(32, dim=1)


def _naive_q(q, q_scale):
    if q_scale is None:
        return q.double()
    lead = q.shape[:-1]
    return _naive_dequant(q, q_scale.view(torch.uint8)).reshape(*lead, D)


def _naive_scores(qf, kf, w):  # qf [R, H, D], kf [N, D], w [R, H] -> [R, N]
    return (torch.einsum("rhd,nd->rhn", qf, kf).clamp(min=0) * w.double()[:, :, None]).sum(1)


def _naive_ragged(q, q_scale, k, k_scale, w, ks, ke, max_k):
    kf = _naive_dequant(k, k_scale.view(torch.uint8))
    full = _naive_scores(_naive_q(q, q_scale), kf, w)
    S, N = full.shape
    out = torch.full((S, max_k if max_k else N), float("-inf"), dtype=torch.float64)
    for i in range(S):
        for n in range(max(int(ks[i]), 0), min(int(ke[i]), N)):
            c = n - int(ks[i]) if max_k else n
            if c < out.shape[1]:
                out[i, c] = full[i, n]
    return out


def _naive_paged(q, q_scale, cache, w, ctx, table, max_ctx):
    B, next_n, H = q.shape[:3]
    page = cache.shape[1]
    flat = cache.reshape(cache.shape[0], -1)
    out = torch.full((B * next_n, max_ctx), float("-inf"), dtype=torch.float64)
    qf = _naive_q(q, q_scale).reshape(B * next_n, H, D)
    for b in range(B):
        for j in range(next_n):
            r = b * next_n + j
            vis = int(ctx[b, j]) if ctx.dim() == 2 else int(ctx[b]) - next_n + j + 1
            for t in range(min(vis, max_ctx)):
                if t // page >= table.shape[1]:
                    break
                p = int(table[b, t // page])
                if not 0 <= p < cache.shape[0]:
                    continue
                row = flat[p, (t % page) * 64:(t % page + 1) * 64]
                sc = flat[p, page * 64 + (t % page) * 4: page * 64 + (t % page + 1) * 4]
                kf = _naive_dequant(row[None], sc[None])
                out[r, t] = _naive_scores(qf[r:r + 1], kf, w[r:r + 1])[0, 0]
    return out


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def _q(lead, H, q_fp4, device="cpu"):
    x = torch.randn(*lead, H, D, device=device)
    if not q_fp4:
        return x.to(FP8), None
    packed, scales = ref.quantize_mxfp4(x * 3)
    return packed, scales.view(torch.int32).reshape(*lead, H)


def _ragged(S, H, N, q_fp4, device="cpu", causal=False):
    q, qs = _q((S,), H, q_fp4, device)
    k, k_scale = ref.quantize_mxfp4(torch.randn(N, D, device=device) * torch.rand(N, 1, device=device) * 8)
    w = torch.randn(S, H, device=device)
    if causal:
        ke = torch.arange(N - S + 1, N + 1, device=device).clamp(min=0).int()
        ks = torch.zeros(S, dtype=torch.int32, device=device)
    else:
        ks = torch.randint(0, max(N, 1), (S,), device=device).int()
        ke = (ks + torch.randint(-4, max(N, 1) + 4, (S,), device=device)).clamp(0, N).int()
    return q, qs, k, k_scale.view(torch.int32).reshape(N), w, ks, ke


def _paged(B, next_n, H, page, lens, ctx_2d, q_fp4, device="cpu", pad_bytes=0):
    pages_per_req = [(x + page - 1) // page for x in lens]
    num_pages = sum(pages_per_req) + 2
    packed = nb.pack_indexer_k_cache_fp4(torch.randn(num_pages * page, D, device=device), page)
    width = page * 68
    store = torch.zeros(num_pages, width + pad_bytes, dtype=torch.uint8, device=device)
    store[:, :width] = packed.reshape(num_pages, width)
    cache = store.as_strided((num_pages, page, 1, 68), (width + pad_bytes, 68, 68, 1))
    perm = torch.randperm(num_pages, device=device).int()
    table = torch.full((B, max([*pages_per_req, 0]) + 2), -1, dtype=torch.int32, device=device)
    table[:, -1] = num_pages + 5  # out of range, past every context
    at = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[at:at + n]
        at += n
    if pages_per_req and pages_per_req[0] > 1:
        table[0, 0] = num_pages + 9  # an out-of-range page inside a context: -inf keys
    lens_t = torch.tensor(lens, device=device)
    if ctx_2d:
        ctx = (lens_t[:, None] - next_n + 1 + torch.arange(next_n, device=device)[None, :]).clamp(min=0).int()
    else:
        ctx = lens_t.int()
    q, qs = _q((B, next_n), H, q_fp4, device)
    w = torch.randn(B * next_n, H, device=device)
    return q, qs, cache, w, ctx, table, max(lens)


def _qarg(q, qs):
    return q if qs is None else (q, qs)


def _assert_logits(out, want, what=""):
    want = want.to(out.device)
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isneginf(out), torch.isneginf(want)), f"{what}: -inf mask differs"
    fin = torch.isfinite(want)
    if fin.any():
        o, r = out[fin].double(), want[fin].double()
        tol = 1e-5 * max(r.abs().max().item(), 1.0)
        err = (o - r).abs().max().item()
        assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------

def test_quantize_mxfp4_codes_and_scales():
    # One block with amax 6 (scale 2^0): codes by rounding, ties to the even code, saturation.
    x = torch.zeros(1, 32)
    x[0, :12] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, -3.2, 0.3, 1.0])
    packed, scales = ref.quantize_mxfp4(x)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(1, 32)[0, :12].tolist()
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 9, 13, 1, 2]
    assert scales.tolist() == [[127]]
    # Scale = smallest power of two >= amax / 6; all-zero block -> 2^-126 (byte 1, from the amax floor).
    y = torch.zeros(1, 64)
    y[0, 0] = 6.0 * 2 ** 5 + 1
    assert ref.quantize_mxfp4(y)[1].tolist() == [[127 + 6, 1]]


@pytest.mark.parametrize("block_kv", [32, 64])
def test_pack_round_trip_and_layout(block_kv):
    N = 70
    k = torch.randn(N, D) * torch.logspace(-3, 3, N)[:, None]
    cache = nb.pack_indexer_k_cache_fp4(k.bfloat16(), block_kv)
    P = (N + block_kv - 1) // block_kv
    assert cache.shape == (P, block_kv, 1, 68) and cache.dtype == torch.uint8
    flat = cache.reshape(P, -1)
    rows = torch.arange(N)
    packed = flat[rows // block_kv].reshape(-1, block_kv * 68)[:, : block_kv * 64].reshape(-1, block_kv, 64)[
        torch.arange(N), rows % block_kv]
    scales = flat[rows // block_kv][:, block_kv * 64:].reshape(-1, block_kv, 4)[torch.arange(N), rows % block_kv]
    deq = _naive_dequant(packed, scales)
    kb = k.bfloat16().double()
    # Error within half the e2m1 step at each value (at most one scale unit), scale minimal.
    scale = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float64)[scales.long()]
    amax = kb.abs().reshape(N, 4, 32).amax(-1)
    assert ((deq - kb).abs().reshape(N, 4, 32) <= scale[..., None] + 1e-30).all()
    assert (amax <= 6 * scale).all() and (amax > 3 * scale).all()
    # Unused slots of the last page are zero.
    tail = N % block_kv
    if tail:
        assert not flat[-1, tail * 64: block_kv * 64].any() and not flat[-1, block_kv * 64 + tail * 4:].any()


# ----------------------------------------------------------------------------------------------
# References against the naive implementation
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_fp4", [False, True])
@pytest.mark.parametrize("max_k", [0, 9])
def test_reference_ragged_vs_naive(q_fp4, max_k):
    torch.manual_seed(1)
    q, qs, k, k_scale, w, ks, ke = _ragged(5, 3, 40, q_fp4)
    out = nb.fp8_fp4_mqa_logits(_qarg(q, qs), (k, k_scale), w, ks, ke, max_k, impl="reference")
    _assert_logits(out, _naive_ragged(q, qs, k, k_scale, w, ks, ke, max_k), "reference ragged")


@pytest.mark.parametrize("q_fp4", [False, True])
@pytest.mark.parametrize("next_n,ctx_2d", [(1, False), (2, True), (2, False)])
def test_reference_paged_vs_naive(q_fp4, next_n, ctx_2d):
    torch.manual_seed(2)
    q, qs, cache, w, ctx, table, max_len = _paged(3, next_n, 3, 32, [70, 1, 33], ctx_2d, q_fp4)
    meta = nb.get_paged_mqa_logits_metadata(ctx, 32, 4)
    out = nb.fp8_fp4_paged_mqa_logits(_qarg(q, qs), cache, w, ctx, table, meta, max_len + 3, impl="reference")
    _assert_logits(out, _naive_paged(q, qs, cache, w, ctx, table, max_len + 3), "reference paged")


# ----------------------------------------------------------------------------------------------
# Triton (interpreter on CPU) against the references
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H", [1, 7, 32, 64])
@pytest.mark.parametrize("q_fp4", [False, True])
def test_triton_ragged(H, q_fp4):
    torch.manual_seed(H)
    S, N = (3, 100) if H < 32 else (2, 70)
    for max_k, causal in ((0, False), (33, False), (0, True)):
        q, qs, k, k_scale, w, ks, ke = _ragged(S, H, N, q_fp4, causal=causal)
        args = (_qarg(q, qs), (k, k_scale), w, ks, ke, max_k)
        want = nb.fp8_fp4_mqa_logits(*args, impl="reference")
        _assert_logits(nb.fp8_fp4_mqa_logits(*args, impl="triton"), want, f"H={H} max_k={max_k}")
    bf16 = nb.fp8_fp4_mqa_logits(*args, logits_dtype=torch.bfloat16, impl="triton")
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want.bfloat16())


@pytest.mark.parametrize("H", [1, 7, 32, 64])
@pytest.mark.parametrize("next_n,ctx_2d,page,pad,q_fp4",
                         [(1, False, 64, 0, False), (2, True, 32, 16, True), (2, False, 64, 4, True),
                          (1, True, 32, 0, True)])
def test_triton_paged(H, next_n, ctx_2d, page, pad, q_fp4):
    torch.manual_seed(10 * H + next_n)
    lens = [0, 130, 5] if H < 32 else [70, 3]
    q, qs, cache, w, ctx, table, max_len = _paged(len(lens), next_n, H, page, lens, ctx_2d, q_fp4, pad_bytes=pad)
    meta = nb.get_paged_mqa_logits_metadata(ctx, page, 4)
    args = (_qarg(q, qs), cache, w, ctx, table, meta, max_len + 10)
    want = nb.fp8_fp4_paged_mqa_logits(*args, impl="reference")
    _assert_logits(nb.fp8_fp4_paged_mqa_logits(*args, impl="triton"), want, f"H={H} next_n={next_n}")


@pytest.mark.parametrize("q_fp4", [False, True])
def test_triton_spans_several_programs(q_fp4):
    """Key ranges over more than one program's ``TILES * BLOCK_N`` keys: every column of every program is
    written, a chunk whose keys are all hidden gives -inf, and the last chunk is partial."""
    from nsa_backend.kernels.indexer import fp4 as k4

    chunk = k4.tiles_for(16) * k4.BLOCK_N  # 5 heads: 16 padded
    torch.manual_seed(3)
    N = 2 * chunk + 77
    q, qs, k, k_scale, w, ks, ke = _ragged(3, 5, N, q_fp4)
    ks[0], ke[0] = chunk + 10, 2 * chunk + 30  # row 0 sees only keys of the second and third programs
    args = (_qarg(q, qs), (k, k_scale), w, ks, ke)
    _assert_logits(nb.fp8_fp4_mqa_logits(*args, impl="triton"), nb.fp8_fp4_mqa_logits(*args, impl="reference"),
                   "ragged")
    lens = [2 * chunk + 40, 5]
    q, qs, cache, w, ctx, table, max_len = _paged(2, 2, 5, 64, lens, False, q_fp4)
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 4)
    args = (_qarg(q, qs), cache, w, ctx, table, meta, max_len + 3)
    _assert_logits(nb.fp8_fp4_paged_mqa_logits(*args, impl="triton"),
                   nb.fp8_fp4_paged_mqa_logits(*args, impl="reference"), "paged")


def test_triton_paged_without_pages():
    q, _ = _q((2, 1), 4, False)
    cache = torch.zeros(1, 64, 1, 68, dtype=torch.uint8)
    ctx = torch.tensor([5, 9], dtype=torch.int32)
    table = torch.zeros(2, 0, dtype=torch.int32)
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 2)
    out = nb.fp8_fp4_paged_mqa_logits(q, cache, torch.ones(2, 4), ctx, table, meta, 12, impl="triton")
    assert out.shape == (2, 12) and torch.isneginf(out).all()


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------

def test_bad_inputs():
    q, qs, k, k_scale, w, ks, ke = _ragged(2, 4, 10, True)
    qe, _ = _q((2,), 4, False)
    with pytest.raises(ValueError, match="q_scale"):
        nb.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke)
    with pytest.raises(ValueError, match="e4m3 queries take no q_scale"):
        nb.fp8_fp4_mqa_logits((qe, qs), (k, k_scale), w, ks, ke)
    with pytest.raises(ValueError, match="served by fp8_mqa_logits"):
        nb.fp8_fp4_mqa_logits(qe, (torch.zeros(10, D).to(FP8), torch.ones(10)), w, ks, ke)
    with pytest.raises(ValueError, match=r"kv\[0\]"):
        nb.fp8_fp4_mqa_logits(qe, (k[:, :32], k_scale), w, ks, ke)
    with pytest.raises(ValueError, match=r"kv\[1\]"):
        nb.fp8_fp4_mqa_logits(qe, (k, k_scale[:5]), w, ks, ke)
    with pytest.raises(ValueError, match="weights"):
        nb.fp8_fp4_mqa_logits(qe, (k, k_scale), w[:, :3], ks, ke)
    with pytest.raises(ValueError, match="logits_dtype"):
        nb.fp8_fp4_mqa_logits(qe, (k, k_scale), w, ks, ke, 0, torch.float16)
    with pytest.raises(ValueError, match="heads H"):
        nb.fp8_fp4_mqa_logits(torch.zeros(2, 129, D).to(FP8), (k, k_scale), torch.ones(2, 129), ks, ke)
    q4, _, cache, w4, ctx, table, _ = _paged(2, 2, 4, 64, [5, 9], True, False)
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 2)
    with pytest.raises(ValueError, match="kv_cache"):
        nb.fp8_fp4_paged_mqa_logits(q4, torch.zeros(2, 64, 1, 132, dtype=torch.uint8), w4, ctx, table, meta, 9)
    with pytest.raises(ValueError, match="next_n"):
        nb.fp8_fp4_paged_mqa_logits(torch.zeros(1, 5, 4, D).to(FP8), cache, torch.ones(5, 4), ctx[:1], table[:1],
                                    meta, 9)
    with pytest.raises(ValueError, match="context_lens"):
        nb.fp8_fp4_paged_mqa_logits(q4, cache, w4, ctx[:, :1], table, meta, 9)
    with pytest.raises(ValueError, match="block_kv"):
        nb.pack_indexer_k_cache_fp4(torch.randn(4, D), 16)
    with pytest.raises(ValueError, match="head dim"):
        nb.pack_indexer_k_cache_fp4(torch.randn(4, 64))


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation for every target architecture
# ----------------------------------------------------------------------------------------------

_AOT_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    from nsa_backend.kernels import aot
    from nsa_backend.kernels.indexer import fp4 as k4

    # Few heads with MXFP4 q; the most heads with both q formats (the largest accumulator, 8 warps).
    jobs = [(kind, arch, hp, q4) for arch in aot.TARGET_ARCHS for kind in ("ragged", "paged")
            for hp, q4 in ((16, True), (128, False), (128, True))]

    def run(job):
        kind, arch, hp, q4 = job
        nw = k4.num_warps_for(hp)
        if kind == "ragged":
            sig = dict(q_ptr="*u8", qs_ptr="*u8", k_ptr="*u8", ks_scale_ptr="*u8", w_ptr="*fp32", ks_ptr="*i32",
                       ke_ptr="*i32", out_ptr="*fp32", N="i32", H="i32", cols="i32", stride_out="i32",
                       D="constexpr", HP="constexpr", BLOCK_N="constexpr", TILES="constexpr", Q_FP4="constexpr",
                       COMPRESSED="constexpr")
            cx = dict(D=128, HP=hp, BLOCK_N=k4.BLOCK_N, TILES=k4.tiles_for(hp), Q_FP4=q4, COMPRESSED=False)
            aligned = ["q_ptr", "qs_ptr", "k_ptr", "ks_scale_ptr", "w_ptr", "ks_ptr", "ke_ptr", "out_ptr"]
            r = aot.compile_for_arch(k4._fp4_ragged_logits_kernel, sig, cx, arch, nw, 1, aligned=aligned)
        else:
            sig = dict(q_ptr="*u8", qs_ptr="*u8", kv_ptr="*u8", w_ptr="*fp32", ctx_ptr="*i32", bt_ptr="*i32",
                       out_ptr="*fp32", H="i32", NEXT_N="i32", max_ctx="i32", num_pages="i32", max_blocks="i32",
                       stride_bt="i32", stride_page="i32", stride_out="i32", D="constexpr", HP="constexpr",
                       PAGE="constexpr", BLOCK_N="constexpr", TILES="constexpr", Q_FP4="constexpr",
                       CTX_2D="constexpr")
            cx = dict(D=128, HP=hp, PAGE=64, BLOCK_N=k4.BLOCK_N, TILES=k4.tiles_for(hp), Q_FP4=q4, CTX_2D=True)
            aligned = ["q_ptr", "qs_ptr", "kv_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "out_ptr", "stride_page"]
            r = aot.compile_for_arch(k4._fp4_paged_logits_kernel, sig, cx, arch, nw, 1, aligned=aligned)
        return [kind, arch, f"HP={hp} q_fp4={q4}", r.shared_bytes, aot.SHARED_MEMORY_LIMIT[arch]]

    import multiprocessing as mp
    with mp.get_context("fork").Pool(max(1, min(8, os.cpu_count() or 1))) as pool:
        rows = pool.map(run, jobs, chunksize=1)
    print("AOT-ROWS " + json.dumps(rows))
""")


def test_aot_compile_all_archs():
    rows = run_aot_script(_AOT_SCRIPT, timeout=900, marker="AOT-ROWS ")
    assert_rows_fit(rows, {80, 86, 89, 90, 100, 120, 121})
    assert len(rows) == 7 * 2 * 3


# ----------------------------------------------------------------------------------------------
# GPU fuzz
# ----------------------------------------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("NSA_FUZZ_CASES", "300"))
FUZZ_HEADS = (1, 7, 8, 24, 32, 64, 100, 128)
# Each GPU fuzz runs as shards of its cases (case % FUZZ_SHARDS), so pytest-xdist spreads them.
FUZZ_SHARDS = 6


@pytest.mark.gpu
def test_fuzz_fp8_fp4_mqa_logits_gpu():
    rng = random.Random(4)
    torch.manual_seed(4)
    for case in range(FUZZ_CASES):
        H = rng.choice(FUZZ_HEADS)
        N = rng.randint(0, 6000)
        S = rng.randint(1, 64)
        q_fp4 = rng.random() < 0.5
        causal = rng.random() < 0.3 and N >= S
        max_k = rng.choice([0, 0, rng.randint(1, N + 5)])
        q, qs, k, k_scale, w, ks, ke = _ragged(S, H, N, q_fp4, "cuda", causal)
        args = (_qarg(q, qs), (k, k_scale), w, ks, ke, max_k)
        _assert_logits(nb.fp8_fp4_mqa_logits(*args, impl="triton"), nb.fp8_fp4_mqa_logits(*args, impl="reference"),
                       f"case {case}: S={S} H={H} N={N} q_fp4={q_fp4} max_k={max_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_fp8_fp4_paged_mqa_logits_gpu(shard):
    rng = random.Random(5)
    torch.manual_seed(5 + shard)
    for case in range(FUZZ_CASES):
        H = rng.choice(FUZZ_HEADS)
        next_n = rng.randint(1, 4)
        B = rng.randint(1, 16)
        lens = [rng.randint(0, 9000) for _ in range(B)]
        page = rng.choice([32, 64])
        ctx_2d = rng.random() < 0.5
        q_fp4 = rng.random() < 0.5
        pad = rng.choice([0, 0, 4, 128])
        extra_ctx = rng.randint(0, 70)
        if case % FUZZ_SHARDS != shard:
            continue
        q, qs, cache, w, ctx, table, max_len = _paged(B, next_n, H, page, lens, ctx_2d, q_fp4, "cuda", pad)
        meta = nb.get_paged_mqa_logits_metadata(ctx, page, 132)
        args = (_qarg(q, qs), cache, w, ctx, table, meta, max_len + extra_ctx)
        _assert_logits(nb.fp8_fp4_paged_mqa_logits(*args, impl="triton"),
                       nb.fp8_fp4_paged_mqa_logits(*args, impl="reference"),
                       f"case {case}: B={B} next_n={next_n} H={H} page={page} q_fp4={q_fp4}")
