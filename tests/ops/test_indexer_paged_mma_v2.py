"""Gluon mma.sync paged indexer logits (sm_89 / 120 / 121, ``next_n`` 1 and 2) against ``nsa_backend.reference``.

CPU: the route's tables and the gate (never taken off CUDA). The ahead-of-time compile of the kernel for
sm_89 / 120 / 121 (no spill, within 99 KiB) is part of ``tests/ops/test_aot_resources.py`` (kind
``paged_gluon`` of the indexer family).
GPU (a Triton with Gluon and a GPU with e4m3, sm_89 or newer): a 300-case seeded fuzz of the kernel called
directly against the reference (one to four rows, head counts 1..64, products in e4m3 and in fp16, contexts
0..70000 in both ``context_lens`` forms, padded page strides, invalid and out-of-range block-table entries,
chunks and extra output columns), the route of the paged launcher under each arch it serves (forced), and
CUDA-graph capture.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from nsa_backend import reference as ref
from nsa_backend.configs import indexer as cfgs
from tests.ops._cuda_graph import capture
from tests.ops.test_indexer import _assert_logits, _paged_term_scale
from tests.ops.test_indexer_paged_gluon import _paged_case

triton = pytest.importorskip("triton")

FUZZ_CASES = min(300, int(os.environ.get("NSA_FUZZ_CASES", "300")))


def _on_gluon_fp8_gpu() -> bool:
    from nsa_backend.kernels._gluon import gluon_importable

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and gluon_importable()


def test_route_tables():
    """The kernel serves the mma.sync archs with e4m3: one row of 17..64 heads (padded to 32 or 64), two to four
    rows of 1..64 (padded to 16, 32 or 64; two rows per program), with a launch that fits two programs in the
    100 KiB of an sm_120 SM (its chunks are planned for them)."""
    assert cfgs.PAGED_MMA_V2_ARCHS == (89, 120, 121)
    assert sorted(cfgs.PAGED_MMA_V2_HEADS) == [1, 2, 3, 4]
    assert cfgs.PAGED_MMA_V2_HEADS[1] == frozenset(range(17, 65))
    for next_n in (2, 3, 4):
        assert cfgs.PAGED_MMA_V2_HEADS[next_n] == frozenset(range(1, 65))
    assert {cfgs.padded_heads(h) for h in cfgs.PAGED_MMA_V2_HEADS[2]} == {16, 32, 64}
    assert cfgs.PAGED_MMA_V2.resident == 2 and not cfgs.PAGED_MMA_V2.tma


def test_gate_off_without_cuda():
    from nsa_backend.kernels.indexer import sm89_gluon_paged as G

    for next_n, heads in ((1, 64), (2, 32), (2, 64)):
        q, cache, *_ = _paged_case(2, heads, [100, 70], False, next_n=next_n)
        for arch in (89, 120, 121, None):
            assert not G.supported(q, cache, arch)


def _fuzz_cases(n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        big = rnd.random() < 0.06
        B = rnd.randint(1, 3 if big else 12)
        top = 70000 if big else rnd.choice([200, 2000, 9000])
        lens = [0 if rnd.random() < 0.15 else rnd.choice([1, 2, 63, 64, 65, rnd.randint(1, top)])
                for _ in range(B)]
        next_n = rnd.choice([1, 1, 2, 2, 3, 4])
        heads = [64, 64, 40, 33, 32, 24, 17] if next_n == 1 else [64, 40, 32, 32, 24, 17, 16, 9, 1]
        cases.append(dict(B=B, H=rnd.choice(heads), next_n=next_n, e4m3=rnd.choice([None, None, True, False]),
                          lens=lens,
                          ctx_2d=rnd.random() < 0.5,
                          pad=rnd.choice([0, 0, 16, 48, 128]), bad_pages=rnd.random() < 0.3,
                          chunk=rnd.choice([None, None, 64, 128, 576, 2048]), extra=rnd.choice([0, 0, 1, 100]),
                          seed=i))
    return cases


@pytest.mark.gpu
def test_paged_mma_v2_gpu_fuzz():
    if not _on_gluon_fp8_gpu():
        pytest.skip("needs a GPU with e4m3 (sm_89+) and Gluon")
    from nsa_backend.kernels.indexer.sm89_gluon_paged import fp8_paged_mqa_logits_mma_v2

    for c in _fuzz_cases(FUZZ_CASES, seed=23):
        q, cache, w, ctx, table, max_len = _paged_case(c["B"], c["H"], c["lens"], c["ctx_2d"], c["pad"],
                                                       bad_pages=c["bad_pages"], device="cuda", seed=c["seed"],
                                                       next_n=c["next_n"])
        max_ctx = max_len + c["extra"]
        want = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_ctx)
        out = fp8_paged_mqa_logits_mma_v2(q, cache, w, ctx, table, max_ctx, chunk=c["chunk"], e4m3=c["e4m3"])
        _assert_logits(out, want, what=f"{c}", scale=_paged_term_scale(q, cache, w, ctx, table, max_ctx))
    print(f"paged mma_v2 fuzz: {FUZZ_CASES} cases passed")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm89", "sm120", "sm121", "sm86"])
def test_paged_mma_v2_route_gpu(monkeypatch, arch):
    """With routing forced to an arch of ``PAGED_MMA_V2_ARCHS`` the paged launcher returns this kernel's result
    for one row of 64 heads and two to four rows, and the ``tl`` kernel's otherwise (one row of 16 heads, sm_86,
    ``NSA_BACKEND_GLUON=0``)."""
    if not _on_gluon_fp8_gpu():
        pytest.skip("needs a GPU with e4m3 (sm_89+) and Gluon")
    from nsa_backend.kernels.indexer import fp8_paged_mqa_logits_triton
    from nsa_backend.kernels.indexer import sm89_gluon_paged as G
    from nsa_backend.routing.config import reset_config

    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", arch)
    reset_config()  # routing re-reads the forced arch
    try:
        _route_checks(monkeypatch, G, fp8_paged_mqa_logits_triton, arch)
    finally:
        monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH")
        reset_config()


def _route_checks(monkeypatch, G, fp8_paged_mqa_logits_triton, arch: str) -> None:
    calls = []
    real = G.fp8_paged_mqa_logits_mma_v2
    monkeypatch.setattr(G, "fp8_paged_mqa_logits_mma_v2", lambda *a, **k: calls.append(1) or real(*a, **k))
    served = arch != "sm86"
    for next_n, heads, routed in ((1, 64, served), (2, 32, served), (2, 64, served), (3, 24, served),
                                  (4, 64, served), (1, 16, False), (1, 64, False)):
        if not routed and heads == 64:
            monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
        q, cache, w, ctx, table, max_len = _paged_case(3, heads, [5000, 64, 1], False, device="cuda", seed=5,
                                                       next_n=next_n)
        before = len(calls)
        got = fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, max_len)
        monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)
        assert len(calls) - before == routed, (arch, next_n, heads)
        _assert_logits(got, ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, max_len),
                       what=f"{arch} next_n {next_n} H {heads}", scale=_paged_term_scale(q, cache, w, ctx, table,
                                                                                          max_len))


@pytest.mark.gpu
@pytest.mark.parametrize(("next_n", "heads"), [(1, 64), (2, 32), (2, 64), (3, 40)])
def test_paged_mma_v2_cuda_graph(next_n, heads):
    """Captured in a CUDA graph and replayed, the kernel gives the eager result."""
    if not _on_gluon_fp8_gpu():
        pytest.skip("needs a GPU with e4m3 (sm_89+) and Gluon")
    from nsa_backend.kernels.indexer.sm89_gluon_paged import fp8_paged_mqa_logits_mma_v2

    q, cache, w, ctx, table, max_len = _paged_case(4, heads, [9000, 1, 0, 4097], True, 16, bad_pages=True,
                                                   device="cuda", seed=9, next_n=next_n)
    eager = fp8_paged_mqa_logits_mma_v2(q, cache, w, ctx, table, max_len)
    graph, out = capture(lambda: fp8_paged_mqa_logits_mma_v2(q, cache, w, ctx, table, max_len))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, out)


def test_e4m3_products_where_the_gpu_multiplies_e4m3_or_fp16_q_does_not_fit(monkeypatch):
    """e4m3 products on sm_89 / 120 / 121, and for two rows of 64 heads anywhere (fp16 ``q^T`` would take 256
    registers); fp16 products elsewhere (an sm_90 GPU under the proxy)."""
    from nsa_backend.kernels.indexer import sm89_gluon_paged as G

    cpu = torch.device("cpu")
    for cap, rows, hp, want in ((90, 1, 64, False), (90, 2, 32, False), (90, 2, 64, True), (None, 1, 16, False),
                                (89, 1, 64, True), (120, 2, 16, True), (121, 1, 32, True), (86, 1, 64, False)):
        monkeypatch.setattr(G, "device_capability", lambda device, c=cap: c)
        assert G.e4m3_products(cpu, rows, hp) is want, (cap, rows, hp)
