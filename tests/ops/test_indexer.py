"""Triton lightning-indexer kernels against ``nsa_backend.reference``.

- CPU (``TRITON_INTERPRET=1``): small shapes covering every feature (head counts that are not a
  power of two, both head dims, both ``clean_logits`` values, compressed output, both
  ``context_lens`` forms, page sizes 32 and 64, padded page stride, empty sequences, unused or
  out-of-range block-table entries), and the paged kernel's launch variants (row loop, page ids
  ahead, unmasked key loads) whichever architecture the tables pick them for.
- Ahead-of-time: every kernel and shipped configuration compiles for sm_80 .. sm_121 within the
  architecture's shared memory (one subprocess, ``TRITON_INTERPRET`` unset).
- GPU (``@pytest.mark.gpu``): 300+ random cases per op.

In-window values are compared with a relative tolerance on the row scale; masks (``-inf``) are
compared exactly wherever the op promises them.
"""

from __future__ import annotations

import os
import random
import textwrap
from dataclasses import replace

import pytest
import torch

import nsa_backend as nb
from nsa_backend import reference as ref
from tests.ops._aot import assert_rows_fit, run_aot_script

FP8 = torch.float8_e4m3fn
triton = pytest.importorskip("triton")
ki = pytest.importorskip("nsa_backend.kernels.indexer")
ci = pytest.importorskip("nsa_backend.configs.indexer")


# ----------------------------------------------------------------------------------------------
# Inputs and comparison
# ----------------------------------------------------------------------------------------------

def _ragged_inputs(S, H, D, N, device, causal=False, gen=None):
    q = torch.randn(S, H, D, device=device).to(FP8)
    k = torch.randn(N, D, device=device).to(FP8)
    k_scale = torch.rand(N, device=device) * 0.9 + 0.1  # arbitrary fp32 scales
    w = torch.randn(S, H, device=device)
    if causal:
        ke = torch.arange(N - S + 1, N + 1, device=device).clamp(min=0).int()
        ks = torch.zeros(S, dtype=torch.int32, device=device)
    else:
        ks = torch.randint(0, max(N, 1), (S,), device=device, generator=gen).int()
        ke = (ks + torch.randint(-4, max(N, 1) + 4, (S,), device=device, generator=gen)).clamp(0, N).int()
    return q, (k, k_scale), w, ks, ke


def _paged_inputs(B, next_n, H, D, page, lens, ctx_2d, device, pad_bytes=0, spare_pages=3):
    """Paged cache with pages in random order, ``spare_pages`` unused, optionally padded stride."""
    lens = [int(x) for x in lens]
    max_len = max([*lens, 0])
    pages_per_req = [(x + page - 1) // page for x in lens]
    max_blocks = max([*pages_per_req, 0]) + 2  # unused trailing block-table entries
    num_pages = sum(pages_per_req) + spare_pages
    k = torch.randn(num_pages * page, D, device=device)
    packed = ref.pack_indexer_k_cache(k, page).view(num_pages, -1)  # [P, page*(D+4)]
    width = packed.shape[1]
    store = torch.zeros(num_pages, width + pad_bytes, dtype=torch.uint8, device=device)
    store[:, :width] = packed
    cache = store[:, :width].view(num_pages, page, 1, D + 4) if pad_bytes == 0 else \
        store.as_strided((num_pages, page, 1, D + 4), (width + pad_bytes, D + 4, D + 4, 1))
    perm = torch.randperm(num_pages, device=device).int()
    table = torch.full((B, max_blocks), -1, dtype=torch.int32, device=device)
    table[:, -1] = num_pages + 7  # an out-of-range id past every context: must never be read
    at = 0
    for b, n in enumerate(pages_per_req):
        table[b, :n] = perm[at:at + n]
        at += n
    if ctx_2d:
        # row j of request b sees keys t < L - next_n + 1 + j (the MTP layout), clamped at 0
        j = torch.arange(next_n, device=device)
        ctx = (torch.tensor(lens, device=device)[:, None] - next_n + 1 + j[None, :]).clamp(min=0).int()
    else:
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(B, next_n, H, D, device=device).to(FP8)
    w = torch.randn(B * next_n, H, device=device)
    return q, cache, w, ctx, table, max_len


def _assert_logits(out, want, check_mask=True, what="", scale=0.0):
    """``out`` equals ``want`` where finite within ``2e-3`` of the larger of their largest magnitude and
    ``scale`` (see :func:`_paged_term_scale`), and is ``-inf`` exactly where ``want`` is."""
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)} != {tuple(want.shape)}"
    fin = torch.isfinite(want)
    if check_mask:
        assert torch.equal(torch.isneginf(out), torch.isneginf(want)), f"{what}: -inf mask differs"
    if fin.any():
        o, r = out[fin].double(), want[fin].double()
        assert torch.isfinite(o).all(), f"{what}: non-finite value inside the window"
        tol = 2e-3 * max(r.abs().max().item(), scale) + 1e-6
        err = (o - r).abs().max().item()
        assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def _paged_term_scale(q, cache, w, ctx, table, max_ctx) -> float:
    """The largest logit with every head's weight taken positive: the size of the terms a logit sums.

    A logit is a weighted sum over heads and can nearly cancel (terms of 20, a sum of 0.2); the fp8
    MMA's rounding follows the terms, so few-key cases bound the error by this instead of the
    result's own magnitude."""
    terms = ref.fp8_paged_mqa_logits(q, cache, w.abs(), ctx, table, None, max_ctx)
    fin = torch.isfinite(terms)
    return terms[fin].abs().max().item() if fin.any() else 0.0


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small cases through the public API
# ----------------------------------------------------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

RAGGED_CASES = [
    pytest.param(5, 3, 64, 70, True, 0, False, id="S5-H3-D64-N70-clean"),
    pytest.param(6, 24, 128, 40, False, 0, False, id="S6-H24-D128-N40-raw"),
    pytest.param(4, 17, 64, 50, False, 30, False, id="S4-H17-D64-N50-compressed30"),
    pytest.param(3, 1, 64, 33, True, 20, False, id="S3-H1-D64-N33-compressed-clean"),
    pytest.param(7, 8, 64, 20, True, 0, True, id="S7-H8-D64-N20-causal"),
    pytest.param(2, 2, 64, 0, True, 0, False, id="N0-empty"),
]


@pytest.mark.parametrize("S,H,D,N,clean,max_k,causal", RAGGED_CASES)
def test_fp8_mqa_logits(S, H, D, N, clean, max_k, causal):
    q, kv, w, ks, ke = _ragged_inputs(S, H, D, N, DEVICE, causal=causal)
    if N > 0:
        ks[0], ke[0] = 3, 3  # an empty window
    want = ref.fp8_mqa_logits(q, kv, w, ks, ke, clean, max_k)
    out = nb.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=clean, max_seqlen_k=max_k, impl="triton")
    if not clean:
        # entries outside the window are unspecified: compare inside only
        out = torch.where(torch.isfinite(want), out, want)
    _assert_logits(out, want, check_mask=True, what="ragged")


PAGED_CASES = [
    pytest.param(3, 1, 4, 64, 64, [70, 0, 130], False, 0, id="nn1-ctx1d-len0"),
    pytest.param(2, 3, 5, 64, 32, [100, 3], True, 16, id="nn3-ctx2d-page32-padded"),
    pytest.param(2, 4, 2, 128, 64, [65, 200], False, 0, id="nn4-ctx1d-D128"),
    pytest.param(2, 2, 16, 64, 64, [1, 64], True, 32, id="nn2-ctx2d-padded"),
]


@pytest.mark.parametrize("B,next_n,H,D,page,lens,ctx_2d,pad", PAGED_CASES)
def test_fp8_paged_mqa_logits(B, next_n, H, D, page, lens, ctx_2d, pad):
    q, cache, w, ctx, table, max_len = _paged_inputs(B, next_n, H, D, page, lens, ctx_2d, DEVICE,
                                                     pad_bytes=pad)
    meta = nb.get_paged_mqa_logits_metadata(ctx, page, 4, impl="triton")
    assert torch.equal(meta, ref.get_paged_mqa_logits_metadata(ctx, page, 4))
    max_ctx = max_len + 9  # columns past every context stay -inf
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx)
    out = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, impl="triton")
    _assert_logits(out, want, what="paged")


@pytest.mark.parametrize("chunk", [64, 128])
def test_fp8_paged_mqa_logits_chunks(chunk):
    # several programs per request: chunk boundaries inside contexts and inside the row windows
    q, cache, w, ctx, table, max_len = _paged_inputs(2, 2, 8, 64, 64, [300, 129], True, DEVICE, pad_bytes=16)
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len + 70)
    out = ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len + 70, chunk=chunk)
    _assert_logits(out, want, what=f"chunk {chunk}")


# Launch variants of the paged kernel that a configuration can select (the shipped tables pick some
# of them per architecture): each must give the same logits and masks as the reference.
PAGED_VARIANTS = [
    pytest.param({"row_loop": True}, id="row-loop"),
    pytest.param({"page_ahead": True}, id="page-ahead"),
    pytest.param({"k_mask": False}, id="unmasked-keys"),
    pytest.param({"row_loop": True, "page_ahead": True, "k_mask": False}, id="row-loop-page-ahead-unmasked"),
]


@pytest.mark.parametrize("variant", PAGED_VARIANTS)
@pytest.mark.parametrize("next_n,ctx_2d,pad", [(2, True, 3), (3, False, 16)],
                         ids=["nn2-ctx2d-unaligned", "nn3-padded"])
def test_fp8_paged_mqa_logits_variants(variant, next_n, ctx_2d, pad):
    # ragged contexts (a partial page, an empty request), unused and out-of-range table entries,
    # several chunks per request
    q, cache, w, ctx, table, max_len = _paged_inputs(3, next_n, 5, 64, 64, [200, 0, 130], ctx_2d, DEVICE,
                                                     pad_bytes=pad)
    cfg = replace(ci.paged_config(5, next_n, 64, None), **variant)
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len + 9)
    for chunk in (None, 64, 128):
        out = ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len + 9, config=cfg,
                                             chunk=chunk)
        _assert_logits(out, want, what=f"{variant} chunk {chunk}")


TUNED_PAGED = [
    *(pytest.param(90, key, ci.PAGED_WGMMA_TUNED[key], id=f"sm90-hp{key[0]}-rows{key[1]}")
      for key in ci.PAGED_WGMMA_TUNED),
    # the entries of every 100 KiB-per-SM part
    *(pytest.param(arch, key, ci.PAGED_SMALL_TUNED[key], id=f"sm{arch}-small-hp{key[0]}-rows{key[1]}")
      for arch in (86, 89, 120, 121) for key in ci.PAGED_SMALL_TUNED),
]


@pytest.mark.parametrize("arch,key,entry", TUNED_PAGED)
def test_fp8_paged_mqa_logits_tuned_entries(arch, key, entry):
    # each per-arch tuned entry is what the table returns for its head bucket and rows, and gives the
    # reference's logits (ragged contexts, an empty request, several chunks per request)
    hp, rows = key
    heads = hp - 3
    cfg = ci.paged_config(heads, rows, 128, arch)
    assert cfg == entry
    q, cache, w, ctx, table, max_len = _paged_inputs(3, rows, heads, 128, 64, [300, 0, 130], False, DEVICE)
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len)
    for chunk in (None, 128):
        out = ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len, config=cfg, chunk=chunk)
        _assert_logits(out, want, what=f"sm_{arch} {key} chunk {chunk}")


def test_head_slices_config_errors():
    """A paged configuration with head slices other than 1 or 2, with slices but no row loop, or with slices
    narrower than one 16-head product is refused before any launch, naming the field."""
    with pytest.raises(ValueError, match="head_slices: expected 1 or 2, got 4"):
        ci.LogitsConfig(64, 64, 4, 3, row_loop=True, head_slices=4)
    with pytest.raises(ValueError, match="head_slices: 2 needs row_loop=True"):
        ci.LogitsConfig(64, 64, 4, 3, head_slices=2)
    q, cache, w, ctx, table, max_len = _paged_inputs(2, 1, 5, 64, 64, [70, 10], False, DEVICE)
    cfg = ci.LogitsConfig(64, 16, 4, 3, row_loop=True, head_slices=2)
    with pytest.raises(ValueError, match=r"config.head_slices: 2 slices need at least 32 padded heads .* got 16"):
        ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len, config=cfg)


def test_paged_chunk_waves():
    # batches that fit one wave: each request cut into the chunks one wave holds (whole tiles, at
    # least PAGED_MIN_CHUNK keys); larger batches: one full wave, else several waves
    assert ci.paged_chunk(128, 4096, 132, 64, resident=6) == 704  # 6 chunks per request: 768 of 792 slots
    assert ci.paged_chunk(128, 65536, 132, 64, resident=6) == 10944
    assert ci.paged_chunk(128, 8192, 132, 64, resident=3) == 2752  # 3 chunks per request
    assert ci.paged_chunk(1, 65536, 132, 64, resident=6) == 512
    assert ci.paged_chunk(1, 65536, 132, 128, resident=6) == 512
    assert ci.paged_chunk(1000, 4096, 132, 64, resident=6) == 2048  # 2000 programs: 2.5 waves
    assert ci.paged_chunk(700, 4096, 132, 64, resident=6) == 4096  # 700 programs: one wave
    for batch, length in [(1, 1), (7, 100), (128, 70000), (3, 5000), (2000, 9000)]:
        for block_n in (64, 128):
            chunk = ci.paged_chunk(batch, length, 132, block_n)
            assert chunk % block_n == 0 and chunk >= ci.PAGED_MIN_CHUNK


def test_fp8_paged_mqa_logits_without_pages():
    # a block table with no column: nothing is visible
    q, cache, w, ctx, table, _ = _paged_inputs(2, 2, 4, 64, 64, [70, 5], False, DEVICE)
    table = table[:, :0]
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 4, impl="triton")
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 80)
    out = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 80, impl="triton")
    _assert_logits(out, want, what="no pages")


@pytest.mark.parametrize("lens,num_sms", [
    pytest.param([0, 300, 0, 1000, 5], 7, id="mixed"),
    pytest.param([0, 0], 3, id="all-empty"),
    pytest.param([4096] * 3, 2, id="fewer-sms"),
    pytest.param([257], 16, id="more-sms"),
])
@pytest.mark.parametrize("ctx_2d", [False, True])
def test_paged_metadata(lens, num_sms, ctx_2d):
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    if ctx_2d:
        ctx = torch.stack([ctx // 2, ctx], dim=1).int()  # DeepGEMM schedules by the last column
    out = ki.get_paged_mqa_logits_metadata_triton(ctx, 64, num_sms)
    assert torch.equal(out, ref.get_paged_mqa_logits_metadata(ctx, 64, num_sms))


def test_paged_metadata_matches_deep_gemm_schedule():
    # ceil(len / 256) segments per request, spread evenly; (B, 0) sentinel when past the end
    ctx = torch.tensor([300, 0, 1000], dtype=torch.int32)
    out = ref.get_paged_mqa_logits_metadata(ctx, 64, 3)  # segments 2, 0, 4 -> 6 over 3 SMs
    assert out.tolist() == [[0, 0], [2, 0], [2, 2], [3, 0]]


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation for every target architecture
# ----------------------------------------------------------------------------------------------

_AOT_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    from nsa_backend.kernels import aot
    from nsa_backend.kernels.aot_registry import indexer_jobs

    full = os.environ.get("NSA_AOT_FULL", "0") == "1"
    # without NSA_AOT_FULL: the largest shared-memory estimate of each kernel
    jobs = [job for arch in aot.TARGET_ARCHS for job in indexer_jobs(arch, largest_only=not full)]

    def run(i):
        job = jobs[i]
        r = job.compile()
        return [job.kind, job.arch, job.config, r.shared_bytes, r.shared_limit]

    import multiprocessing as mp
    with mp.get_context("fork").Pool(max(1, min(8, os.cpu_count() or 1))) as pool:
        rows = pool.map(run, range(len(jobs)), chunksize=1)
    print("AOT-ROWS " + json.dumps(rows))
    for row in rows:
        print(*row)
""")


def test_aot_compile_all_archs():
    rows = run_aot_script(_AOT_SCRIPT, timeout=900, marker="AOT-ROWS ")
    assert_rows_fit(rows, {80, 86, 89, 90, 100, 120, 121})


# ----------------------------------------------------------------------------------------------
# GPU fuzz
# ----------------------------------------------------------------------------------------------

FUZZ_HEADS = (1, 8, 24, 32, 64, 128)
FUZZ_CASES = int(os.environ.get("NSA_FUZZ_CASES", "300"))
# Each GPU fuzz runs as shards of its cases (case % FUZZ_SHARDS), so pytest-xdist spreads them.
FUZZ_SHARDS = 6


@pytest.mark.gpu
def test_fuzz_fp8_mqa_logits_gpu():
    rng = random.Random(1234)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for case in range(FUZZ_CASES):
        H = rng.choice(FUZZ_HEADS)
        D = 128 if rng.random() < 0.8 else 64
        big = rng.random() < 0.1
        N = rng.randint(0, 70000) if big else rng.randint(0, 3000)
        S = rng.randint(1, 8) if big else rng.randint(1, 96)
        clean = rng.random() < 0.5
        causal = rng.random() < 0.3 and N >= S
        max_k = rng.choice([0, 0, rng.randint(1, max(N, 1) + 5)])
        q, kv, w, ks, ke = _ragged_inputs(S, H, D, N, "cuda", causal=causal, gen=gen)
        want = ref.fp8_mqa_logits(q, kv, w, ks, ke, clean, max_k)
        out = nb.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=clean, max_seqlen_k=max_k, impl="triton")
        if not clean:
            out = torch.where(torch.isfinite(want), out, want)
        _assert_logits(out, want, what=f"case {case}: S={S} H={H} D={D} N={N} clean={clean} max_k={max_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_fp8_paged_mqa_logits_gpu(shard):
    rng = random.Random(99)
    for case in range(FUZZ_CASES):
        H = rng.choice(FUZZ_HEADS)
        D = 128 if rng.random() < 0.8 else 64
        page = 32 if rng.random() < 0.2 else 64
        next_n = rng.randint(1, 4)
        B = rng.randint(1, 12)
        big = rng.random() < 0.08
        lens = [rng.choice([0, rng.randint(1, 70000 if big else 2000)]) if rng.random() < 0.2
                else rng.randint(1, 70000 if big else 2000) for _ in range(B)]
        if big:
            B = min(B, 3)
            lens = lens[:B]
        ctx_2d = rng.random() < 0.5
        pad = rng.choice([0, 0, 16, 64])
        num_sms = rng.choice([1, 7, 132])
        extra_ctx = rng.choice([0, 1, 100])
        if case % FUZZ_SHARDS != shard:
            continue
        q, cache, w, ctx, table, max_len = _paged_inputs(B, next_n, H, D, page, lens, ctx_2d, "cuda", pad)
        meta = nb.get_paged_mqa_logits_metadata(ctx, page, num_sms, impl="triton")
        want_meta = ref.get_paged_mqa_logits_metadata(ctx, page, num_sms)
        assert torch.equal(meta, want_meta), f"case {case}: metadata"
        max_ctx = max_len + extra_ctx
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx)
        out = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_ctx, impl="triton")
        _assert_logits(out, want, what=f"case {case}: B={B} next_n={next_n} H={H} D={D} page={page} "
                                       f"ctx_2d={ctx_2d} pad={pad} lens={lens}")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_paged_metadata_gpu(shard):
    rng = random.Random(7)
    for case in range(FUZZ_CASES):
        B = rng.randint(0, 2000)
        next_n = rng.randint(1, 4)
        high = rng.choice([1, 300, 70000])
        two_d = rng.random() < 0.5
        num_sms = rng.choice([1, 2, 78, 132, 148, 170])
        if case % FUZZ_SHARDS != shard:
            continue
        lens = torch.randint(0, high, (B, next_n), dtype=torch.int32, device="cuda")
        ctx = lens if two_d else lens[:, 0].contiguous()
        out = nb.get_paged_mqa_logits_metadata(ctx, 64, num_sms, impl="triton")
        assert torch.equal(out, ref.get_paged_mqa_logits_metadata(ctx, 64, num_sms)), f"case {case}: B={B}"


@pytest.mark.gpu
def test_paged_logits_decode_shapes_gpu():
    # the launch configurations and key chunks of decode batches (every chunk of PAGED_CHUNKS),
    # both context_lens forms, padded and unaligned page strides
    rng = random.Random(3)
    for B, L, next_n, H, ctx_2d, pad in [(128, 8192, 1, 64, False, 0), (128, 8192, 2, 64, True, 16),
                                         (64, 20000, 2, 64, False, 0), (32, 40000, 1, 32, True, 3),
                                         (8, 9000, 4, 64, False, 64)]:
        lens = [rng.randint(1, L) for _ in range(B)]
        lens[0] = L
        q, cache, w, ctx, table, max_len = _paged_inputs(B, next_n, H, 128, 64, lens, ctx_2d, "cuda", pad)
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 132, impl="triton")
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len)
        out = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len, impl="triton")
        _assert_logits(out, want, what=f"B={B} L={L} next_n={next_n} H={H}")
        for chunk in ci.PAGED_CHUNKS:
            out = ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, meta, max_len, chunk=chunk)
            _assert_logits(out, want, what=f"B={B} L={L} next_n={next_n} H={H} chunk={chunk}")


@pytest.mark.gpu
def test_paged_logits_graph_capture_gpu():
    q, cache, w, ctx, table, _ = _paged_inputs(4, 2, 64, 128, 64, [500, 0, 64, 1000], True, "cuda")
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 132, impl="triton")
    nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 1024, impl="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta_g = nb.get_paged_mqa_logits_metadata(ctx, 64, 132, impl="triton")
        out_g = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta_g, 1024, impl="triton")
    ctx.copy_(torch.tensor([[10, 11], [0, 0], [900, 901], [1000, 1000]], dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 1024)
    _assert_logits(out_g, want, what="graph replay")
    assert torch.equal(meta_g, ref.get_paged_mqa_logits_metadata(ctx, 64, 132))
