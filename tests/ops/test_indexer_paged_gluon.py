"""Gluon paged indexer logits (sm_90, ``next_n`` 1 and 2) against ``nsa_backend.reference``.

CPU: the dispatch gate (never taken off CUDA or in the interpreter), the shape rules, the cache of
TMA descriptors (hits, keys, eviction; no tensor kept alive), and an ahead-of-time compile for sm_90
of every stage count the configuration can pick, within the shared memory of sm_90 (skipped when
the installed Triton has no usable Gluon).
GPU (sm_90 with Gluon): a seeded fuzz against the reference (head counts 8..128, contexts 0..70000
in both ``context_lens`` forms, padded page strides, invalid and out-of-range block-table entries,
stage counts, chunks and extra output columns), the route of the paged launcher (Gluon where
supported, the ``tl`` kernel with ``NSA_BACKEND_GLUON=0``), CUDA-graph capture and launches on
caches that reuse the memory of freed ones.
"""

from __future__ import annotations

import os
import random
import textwrap

import pytest
import torch

from nsa_backend import reference as ref
from tests.ops._aot import run_aot_script
from tests.ops._cuda_graph import capture
from tests.ops._gluon import on_sm90_gluon
from tests.ops.test_indexer import _assert_logits, _paged_term_scale

FP8 = torch.float8_e4m3fn
triton = pytest.importorskip("triton")



def _paged_case(B, H, lens, ctx_2d, pad=0, spare=3, bad_pages=False, device="cpu", seed=0, next_n=2):
    """Pages of 64 keys in random order, D 128; ``pad`` bytes after each page."""
    gen = torch.Generator(device=device).manual_seed(seed)
    page, D = 64, 128
    lens = [int(x) for x in lens]
    per_req = [(x + page - 1) // page for x in lens]
    max_blocks = max([*per_req, 0]) + 2  # unused trailing block-table entries
    P = sum(per_req) + spare
    k = torch.randn(P * page, D, device=device, generator=gen)
    packed = ref.pack_indexer_k_cache(k, page).view(P, -1)
    width = packed.shape[1]
    store = torch.zeros(P, width + pad, dtype=torch.uint8, device=device)
    store[:, :width] = packed
    cache = store.as_strided((P, page, 1, D + 4), (width + pad, D + 4, D + 4, 1))
    perm = torch.randperm(P, device=device, generator=gen).int()
    table = torch.full((B, max_blocks), -1, dtype=torch.int32, device=device)
    table[:, -1] = P + 7  # out of range, past every context
    at = 0
    for b, n in enumerate(per_req):
        table[b, :n] = perm[at:at + n]
        at += n
    if bad_pages:
        for b, n in enumerate(per_req):
            if n >= 2:
                table[b, 1] = -1  # a page inside the context that holds no key
            if n >= 3:
                table[b, 2] = P + 100
    if ctx_2d:
        j = torch.arange(next_n, device=device)
        ctx = (torch.tensor(lens, device=device)[:, None] - next_n + 1 + j[None, :]).clamp(min=0).int()
    else:
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(B, next_n, H, D, device=device, generator=gen).to(FP8)
    w = torch.randn(B * next_n, H, device=device, generator=gen)
    return q, cache, w, ctx, table, max([*lens, 0])


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------

def test_gate_off_without_cuda():
    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    q, cache, *_ = _paged_case(2, 64, [70, 5], False)
    assert G.shape_supported(q, cache)
    assert not G.supported(q, cache, None)
    assert not G.supported(q, cache, 90)  # CPU tensors (and the interpreter) never take it
    assert G.GLUON_ARCHS == (90,)


def test_shape_rules():
    from nsa_backend.configs import indexer as ci
    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    q, cache, *_ = _paged_case(2, 64, [70, 5], False)
    assert G.shape_supported(q, cache.squeeze(2))
    assert G.shape_supported(q[:, :1].contiguous(), cache) == (1 in ci.PAGED_GLUON)
    assert not G.shape_supported(torch.zeros(2, 3, 64, 128, dtype=FP8), cache)  # next_n 3: tl kernel
    assert not G.shape_supported(torch.zeros(2, 2, 64, 64, dtype=FP8), cache)  # D 64
    assert not G.shape_supported(torch.zeros(2, 2, 128, 128, dtype=FP8), cache)  # H 128: tl kernel
    _, padded, *_ = _paged_case(2, 64, [70, 5], False, pad=16)  # not whole 128-byte rows: cp.async launch
    assert G.shape_supported(q, padded) == (2 in ci.PAGED_GLUON_CP)
    _, odd, *_ = _paged_case(2, 64, [70, 5], False, pad=4)  # page stride not a multiple of 16
    assert not G.shape_supported(q, odd)


def test_tma_rule():
    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    for pad, ok in ((0, True), (128, True), (16, False), (64, False)):
        _, cache, *_ = _paged_case(2, 64, [70, 5], False, pad=pad)
        assert G.tma_supported(cache) == ok, pad
        cfg = G.launch_config(2, cache)
        assert cfg.tma == ok and (not cfg.warp_specialize or ok)


def _needs_gluon():
    from nsa_backend.kernels._gluon import gluon_importable

    if not gluon_importable():
        pytest.skip("this Triton has no usable Gluon")


def _desc_fields(desc) -> tuple:
    return (desc.base.data_ptr(), desc.base.dtype, list(desc.shape), list(desc.strides), list(desc.block_shape),
            repr(desc.layout), desc.padding)


@pytest.fixture
def descriptor_cache(monkeypatch):
    """An empty descriptor cache of 4 entries for the test."""
    from collections import OrderedDict

    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    monkeypatch.setattr(G, "_DESCRIPTORS", OrderedDict())
    monkeypatch.setattr(G, "DESCRIPTOR_CACHE_SIZE", 4)
    return G


def test_descriptor_cache_hits(descriptor_cache):
    """A second call on the cache, or on another view of it with the same address, shape and strides,
    reuses the descriptors; they equal a fresh build and hold no tensor."""
    _needs_gluon()
    G = descriptor_cache
    _, cache, *_ = _paged_case(2, 64, [70, 5], False, pad=128)
    first = G._cached_descriptors(cache)
    assert G._cached_descriptors(cache) is first
    assert G._cached_descriptors(cache.view(cache.shape)) is first  # another tensor object, same key
    assert len(G._DESCRIPTORS) == 1
    fresh = G._tma_descriptors(cache)
    assert first[2] == fresh[2] == cache.stride(0) // 128
    for got, want in zip(first[:2], fresh[:2]):
        assert _desc_fields(got) == _desc_fields(want)
        assert not any(isinstance(v, torch.Tensor) for v in vars(got).values())  # the memory may be freed


def test_descriptor_cache_key(descriptor_cache):
    """Another start address, page count or page stride is another entry with its own descriptors."""
    _needs_gluon()
    G = descriptor_cache
    _, padded, *_ = _paged_case(2, 64, [70, 5], False, spare=5, pad=128)
    base = G._cached_descriptors(padded)
    narrow = padded.as_strided(padded.shape, (128 * 66, 132, 132, 1))  # same address and shape, other stride
    fewer = padded[:-1]  # same address and strides, fewer pages
    later = padded[1:]  # same shape and strides as fewer, another address
    assert narrow.data_ptr() == padded.data_ptr() and narrow.stride(0) != padded.stride(0)
    keys = {G._descriptor_key(v) for v in (padded, narrow, fewer, later)}
    assert len(keys) == 4
    seen = [base]
    for view in (narrow, fewer, later):
        got = G._cached_descriptors(view)
        assert all(got is not other for other in seen)
        fresh = G._tma_descriptors(view)
        assert got[2] == fresh[2]
        for a, b in zip(got[:2], fresh[:2]):
            assert _desc_fields(a) == _desc_fields(b)
        seen.append(got)
    assert len(G._DESCRIPTORS) == 4
    assert seen[1][2] != seen[0][2]  # page rows follow the stride


def test_descriptor_cache_eviction(descriptor_cache):
    """At most DESCRIPTOR_CACHE_SIZE entries; the least recently used goes first."""
    _needs_gluon()
    G = descriptor_cache
    _, cache, *_ = _paged_case(2, 64, [70, 5], False, spare=8)
    views = [cache[i:] for i in range(6)]  # six start addresses
    first = [G._cached_descriptors(v) for v in views[:4]]
    assert G._cached_descriptors(views[0]) is first[0]  # now the most recently used
    G._cached_descriptors(views[4])  # evicts views[1]
    assert len(G._DESCRIPTORS) == 4
    assert G._cached_descriptors(views[0]) is first[0]
    assert G._cached_descriptors(views[2]) is first[2]
    again = G._cached_descriptors(views[1])  # rebuilt (evicts views[3])
    assert again is not first[1] and _desc_fields(again[0]) == _desc_fields(first[1][0])
    assert G._descriptor_key(views[3]) not in G._DESCRIPTORS
    assert G._descriptor_key(views[4]) in G._DESCRIPTORS


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter")
def test_tl_route_off_cuda():
    """Off CUDA (the interpreter) the paged launcher keeps the ``tl`` kernel."""
    from nsa_backend.kernels.indexer import fp8_paged_mqa_logits_triton

    q, cache, w, ctx, table, max_len = _paged_case(2, 40, [130, 0], True, bad_pages=True)
    out = fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len + 3)
    _assert_logits(out, ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len + 3), what="tl route")


_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels._gluon import gluon_importable
    rows = []
    if gluon_importable():
        from nsa_backend.configs import indexer as ci
        from nsa_backend.kernels.indexer import sm90_gluon_paged as G
        launches = [(n, c, True) for n, c in ci.PAGED_GLUON.items()]
        launches += [(n, c, True) for n, c in ci.PAGED_GLUON_CP.items()] + [(1, G._FALLBACK, False)]
        for next_n, cfg, shipped in launches:
            for ctx_2d in (False, True):
                k = G.compile_for_sm90(cfg, hp=64, next_n=next_n, ctx_2d=ctx_2d)
                rows.append([next_n, repr(cfg), ctx_2d, int(k.metadata.shared),
                             cfg.shared_bytes_estimate(128, 64, next_n), shipped, cfg.resident,
                             cfg.max_regs, cfg.warp_specialize])
    print(json.dumps(rows))
""")


def test_aot_sm90_fits_shared_memory():
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    if not gluon_importable():
        pytest.skip("this Triton has no usable Gluon")
    rows = run_aot_script(_AOT_SCRIPT, timeout=600)
    assert rows
    for next_n, cfg, ctx_2d, shared, estimate, shipped, resident, max_regs, ws in rows:
        what = f"next_n {next_n} {cfg} ctx_2d {ctx_2d}: {shared} B shared"
        assert 0 < shared <= SHARED_MEMORY_LIMIT[90], what
        assert shared <= estimate + 1024, f"{what}, estimate {estimate} B"
        if shipped:  # the programs per SM the chunk rule is planned with fit in shared memory and registers
            assert resident * (shared + 1024) <= 228 * 1024, f"{what} x {resident} programs"
            if ws:  # the loader warp makes the launch two warpgroups
                assert max_regs and resident * max_regs * 256 <= 65536, f"{what}: {max_regs} registers"


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)
# ------------------------------------------------------------------------------------------------

# Random cases of the GPU fuzz (``NSA_FUZZ_CASES`` caps it, as in ``test_indexer.py``).
FUZZ_CASES = min(160, int(os.environ.get("NSA_FUZZ_CASES", "160")))


def _fuzz_configs() -> list:
    """``None`` (the tables) and launches the tables do not pick: other stage counts and unrolls, TMA
    without the loader partition, ``cp.async``."""
    from nsa_backend.configs.indexer import PagedGluonConfig as C

    return [None, None, None, C(3, 3, unroll=1, tma=False), C(6, 3, unroll=4, tma=False), C(4, 4, tma=True),
            C(6, 3, warp_specialize=True, max_regs=80), C(3, 3, unroll=1, warp_specialize=True, max_regs=80)]


_FUZZ_CONFIGS = _fuzz_configs()


def _fuzz_cases(n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        big = rnd.random() < 0.06
        B = rnd.randint(1, 3 if big else 12)
        top = 70000 if big else rnd.choice([200, 2000, 9000])
        lens = [0 if rnd.random() < 0.15 else rnd.choice([1, 2, 63, 64, 65, rnd.randint(1, top)])
                for _ in range(B)]
        cases.append(dict(
            B=B, H=rnd.choice([64, 64, 40, 33, 24]), lens=lens, ctx_2d=rnd.random() < 0.5,
            pad=rnd.choice([0, 0, 16, 48, 128]), bad_pages=rnd.random() < 0.3,
            config=rnd.choice(_FUZZ_CONFIGS),
            chunk=rnd.choice([None, None, 64, 128, 576, 2048]),
            extra=rnd.choice([0, 0, 1, 100]), seed=i, next_n=rnd.choice([1, 2, 2]),
        ))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [False, True], ids=["shipped-table", "ws-4-3"])
def test_gluon_paged_one_key_two_rows_gpu(ws):
    """One request of one key at next_n 2 (row 0 sees no key, row 1 one key), a padded page stride,
    chunks of 128 keys and one extra output column. Its only logit nearly cancels (head terms up to
    about 20 summing to -0.17), so the fp8 MMA's rounding (4e-3 here) is checked against the size of
    the terms: the bound of the result's own size would fail every correct kernel."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.configs.indexer import PagedGluonConfig as C
    from nsa_backend.kernels.indexer.sm90_gluon_paged import fp8_paged_mqa_logits_gluon

    config = C(4, 3, warp_specialize=True, max_regs=80) if ws else None
    for seed in (120, 121, 122):
        q, cache, w, ctx, table, max_len = _paged_case(1, 24, [1], False, 16, bad_pages=False, device="cuda",
                                                       seed=seed, next_n=2)
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len + 1)
        out = fp8_paged_mqa_logits_gluon(q, cache, w, ctx, table, max_len + 1, config=config, chunk=128)
        scale = _paged_term_scale(q, cache, w, ctx, table, max_len + 1)
        if seed == 120:  # the case still cancels: its terms are far larger than its logit
            assert scale > 10 * want[torch.isfinite(want)].abs().max().item()
        _assert_logits(out, want, what=f"seed {seed}", scale=scale)


@pytest.mark.gpu
def test_gluon_paged_gpu_fuzz():
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.kernels.indexer.sm90_gluon_paged import fp8_paged_mqa_logits_gluon

    for c in _fuzz_cases(FUZZ_CASES, seed=11):
        q, cache, w, ctx, table, max_len = _paged_case(c["B"], c["H"], c["lens"], c["ctx_2d"], c["pad"],
                                                       bad_pages=c["bad_pages"], device="cuda", seed=c["seed"],
                                                       next_n=c["next_n"])
        max_ctx = max_len + c["extra"]
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_ctx)
        out = fp8_paged_mqa_logits_gluon(q, cache, w, ctx, table, max_ctx, config=c["config"], chunk=c["chunk"])
        _assert_logits(out, want, what=f"{c}", scale=_paged_term_scale(q, cache, w, ctx, table, max_ctx))


@pytest.mark.gpu
def test_gluon_paged_route_gpu(monkeypatch):
    """The paged launcher takes the Gluon kernel where the tables have a launch (H 64), the ``tl``
    kernel with ``NSA_BACKEND_GLUON=0``; both match the reference, through the public op too."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    import nsa_backend as nb
    from nsa_backend.kernels.indexer import fp8_paged_mqa_logits_triton
    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    for pad, next_n in ((0, 2), (16, 2), (0, 1), (16, 1)):  # TMA + loader partition, cp.async
        q, cache, w, ctx, table, max_len = _paged_case(5, 64, [3000, 0, 1, 700, 5000], True, pad=pad,
                                                       bad_pages=True, device="cuda", seed=3, next_n=next_n)
        what = f"pad {pad} next_n {next_n}"
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len + 5)
        monkeypatch.setenv("NSA_BACKEND_GLUON", "1")
        routed = G.supported(q, cache, 90)
        assert routed == (G.ENABLED and G.shape_supported(q, cache)), what
        got = fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len + 5)
        if routed:
            assert torch.equal(got, G.fp8_paged_mqa_logits_gluon(q, cache, w, ctx, table, max_len + 5)), what
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 132, impl="triton")
        pub = nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, max_len + 5, impl="triton")
        monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
        assert not G.supported(q, cache, 90)
        tl_out = fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len + 5)
        for name, out in (("route", got), ("public", pub), ("tl", tl_out)):
            _assert_logits(out, want, what=f"{what} {name}")


@pytest.mark.gpu
def test_gluon_paged_cuda_graph():
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.kernels.indexer.sm90_gluon_paged import fp8_paged_mqa_logits_gluon

    q, cache, w, ctx, table, max_len = _paged_case(16, 64, [4096] * 8 + [0, 1, 65, 5000, 64, 128, 300, 2],
                                                   False, device="cuda", seed=5)

    def call():
        return fp8_paged_mqa_logits_gluon(q, cache, w, ctx, table, max_len)

    want = call()
    g, got = capture(call)
    ctx[8] = 3000  # graph inputs are read at replay time
    g.replay()
    torch.cuda.synchronize()
    _assert_logits(got, ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len), what="graph replay")
    ctx[8] = 0
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gluon_paged_descriptor_reuse_gpu():
    """Launches reuse the cached descriptors of a cache; a new cache at the address of a freed one (same
    shape and strides) computes from its own contents; another page stride is another entry."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.kernels.indexer import sm90_gluon_paged as G

    lens = [3000, 0, 700, 5000]
    for seed, pad in ((1, 0), (2, 0), (3, 128)):  # the second cache usually takes the first one's memory
        q, cache, w, ctx, table, max_len = _paged_case(4, 64, lens, False, pad=pad, bad_pages=True, device="cuda",
                                                       seed=seed)
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len)
        for _ in range(2):
            _assert_logits(G.fp8_paged_mqa_logits_gluon(q, cache, w, ctx, table, max_len), want, what=f"seed {seed}")
        assert G._descriptor_key(cache) in G._DESCRIPTORS
        del q, cache, w, ctx, table
