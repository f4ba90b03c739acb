"""Gluon mHC pre-norm GEMM (sm_90, ``N <= 32``) against ``nsa_backend.reference``.

CPU: the dispatch gate (never taken off CUDA, in the interpreter or when the route is off), the
launch plan (the chunks of an output tile cover each column block once and fill the GPU), and an
ahead-of-time compile for sm_90
of every routed configuration within the shared memory of sm_90 (skipped when the installed Triton
has no usable Gluon).
GPU (sm_90 with Gluon): a seeded fuzz against the reference (M 1..8192, N 8 / 24 / 32, K 7168 /
28672, ``num_splits`` None / 1 / 4 / 16, every routed configuration and a few others), results
identical over repeated calls, CUDA-graph capture (replays after the inputs change), the route of
the launcher, and the arrival counters left at zero.
"""

from __future__ import annotations

import os
import random
import textwrap

import pytest
import torch

from nsa_backend import reference as ref
from nsa_backend.configs import mhc as cfgs
from tests.ops._aot import run_aot_script
from tests.ops._cuda_graph import capture
from tests.ops._gluon import on_sm90_gluon

triton = pytest.importorskip("triton")

# Error bounds relative to the RMS of the reference output (two bf16 parts of b: 16 significant bits).
TOL_D = 4e-4
TOL_SQ = 1e-5


@pytest.mark.parametrize("m,k,splits,block_m,slots", [
    (2048, 28672, 1, 128, 132), (1024, 28672, 1, 256, 132), (1, 7168, 1, 128, 132), (70, 320, 4, 64, 132),
    (16384, 28672, 1, 128, 132), (100000, 28672, 1, 128, 132), (3000, 7168, 16, 64, 7), (129, 448, 7, 128, 1000),
])
def test_plan_chunks_cover_every_block_once(m, k, splits, block_m, slots):
    """The chunks of an output tile take the split's column blocks ``c, c + C, ...``: together every block
    once (the kernel's ``n_units``), and the grid fits ``slots`` programs where the tiles allow."""
    from nsa_backend.kernels import mhc_gluon as G

    kbs, tiles, chunks = G._plan(m, k, splits, block_m, slots)
    assert kbs == -(-(k // 64) // splits) and tiles == -(-m // block_m)
    assert 1 <= chunks <= kbs
    assert splits * tiles * chunks <= max(slots, splits * tiles)
    blocks = []
    for c in range(chunks):
        n_units = max(kbs - c + chunks - 1, 0) // chunks
        blocks += [c + j * chunks for j in range(n_units)]
    assert sorted(blocks) == list(range(kbs))


def test_gate_off_cuda_and_routes(monkeypatch):
    from nsa_backend.kernels import mhc_gluon as G

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(24, 128)
    assert not G.supported(a, b, None, 90)  # CPU tensors
    monkeypatch.setattr(cfgs, "GLUON_ENABLED", True)
    assert cfgs.gluon_route(256, 24, 90) is not None
    assert cfgs.gluon_route(256, 24, 120) is None
    assert cfgs.gluon_route(256, 40, 90) is None
    assert cfgs.gluon_route(cfgs.GLUON_MIN_M - 1, 24, 90) is None
    monkeypatch.setattr(cfgs, "GLUON_ENABLED", False)
    assert cfgs.gluon_route(256, 24, 90) is None
    assert G.shape_supported(a, b, 4) and not G.shape_supported(a, torch.zeros(40, 128), None)
    assert G._plan(2048, 28672, 1, 128, 132) == (448, 16, 8)


_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels._gluon import gluon_importable
    rows = []
    if gluon_importable():
        from nsa_backend.configs import mhc as cfgs
        from nsa_backend.kernels import mhc_gluon as G
        for cfg in sorted({c for _, c in cfgs.GLUON_ROUTES} | set(cfgs.GLUON_TEST_CONFIGS), key=repr):
            k = G.compile_for_sm90(cfg)
            rows.append([repr(cfg), int(k.metadata.shared), cfg.shared_bytes_estimate(), cfg.programs_per_sm])
        from nsa_backend.kernels.aot import compile_for_arch
        for pdl in (False, True):  # the split kernel of the presplit launches
            k = compile_for_arch(G._mhc_gluon_split_b_kernel,
                                 {"b_ptr": "*fp32", "bp_ptr": "*bf16", "N": "i32", "K": "i32", "ROWS": "constexpr",
                                  "BLOCK": "constexpr", "USE_PDL": "constexpr"},
                                 {"ROWS": 32, "BLOCK": G.SPLIT_BLOCK, "USE_PDL": pdl}, 90, 4, 3,
                                 aligned=("b_ptr", "bp_ptr", "K"))
            rows.append(["split pdl " + str(pdl), int(k.shared_bytes), 1024, 1])
    print(json.dumps(rows))
""")


def test_aot_sm90_fits_shared_memory():
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    if not gluon_importable():
        pytest.skip("this Triton has no usable Gluon")
    rows = run_aot_script(_AOT_SCRIPT, timeout=600)
    assert rows
    for cfg, shared, estimate, per_sm in rows:
        assert 0 <= shared <= SHARED_MEMORY_LIMIT[90], f"{cfg}: {shared} B shared"
        assert shared <= estimate + 1024, f"{cfg}: {shared} B shared, estimate {estimate} B"
        assert per_sm * (shared + 1024) <= 228 * 1024, f"{cfg}: {per_sm} programs per SM"


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)
# ------------------------------------------------------------------------------------------------

FUZZ_CASES = min(120, int(os.environ.get("NSA_FUZZ_CASES", "120")))
gpu = pytest.mark.skipif(not on_sm90_gluon(), reason="needs an sm_90 GPU and Gluon")


def _inputs(m, n, k, splits, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    lead = () if splits is None else (splits,)
    d = torch.full((*lead, m, n), float("nan"), device="cuda")
    sq = torch.full((*lead, m), float("nan"), device="cuda")
    return a, b, d, sq


def _rel_err(x, r):
    return ((x - r).abs().max() / r.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _check(a, b, d, sq, splits, case):
    d_ref, sq_ref = torch.empty_like(d), torch.empty_like(sq)
    ref.tf32_hc_prenorm_gemm(a, b, d_ref, sq_ref, splits)
    assert not d.isnan().any() and not sq.isnan().any(), f"unwritten outputs: {case}"
    err_d, err_sq = _rel_err(d, d_ref), _rel_err(sq, sq_ref)
    assert err_d < TOL_D and err_sq < TOL_SQ, f"d {err_d:.2e} sqr_sum {err_sq:.2e}: {case}"
    return err_d


def _fuzz_cases(count, seed=2024):
    rng = random.Random(seed)
    configs = [None, *cfgs.GLUON_TEST_CONFIGS]
    out = []
    for i in range(count):
        m = round(2 ** rng.uniform(0, 13)) if i % 6 else rng.choice([1, 65, 1024, 2048, 8192])
        out.append((max(1, min(m, 8192)), rng.choice([8, 24, 32]), rng.choice([7168, 28672]),
                    rng.choice([None, 1, 4, 16]), configs[i % len(configs)]))
    return out


@pytest.mark.gpu
@gpu
def test_gpu_fuzz():
    from nsa_backend.kernels import mhc_gluon as G

    torch.backends.cuda.matmul.allow_tf32 = False
    worst = 0.0
    for i, (m, n, k, splits, cfg) in enumerate(_fuzz_cases(FUZZ_CASES)):
        a, b, d, sq = _inputs(m, n, k, splits, seed=i)
        G.tf32_hc_prenorm_gemm_gluon(a, b, d, sq, splits, config=cfg)
        worst = max(worst, _check(a, b, d, sq, splits, (m, n, k, splits, cfg)))
        d2, sq2 = torch.full_like(d, float("nan")), torch.full_like(sq, float("nan"))
        G.tf32_hc_prenorm_gemm_gluon(a, b, d2, sq2, splits, config=cfg)
        assert torch.equal(d, d2) and torch.equal(sq, sq2), f"not deterministic: {(m, n, k, splits, cfg)}"
    print(f"mhc gluon fuzz: {FUZZ_CASES} cases, max error d {worst:.2e} of the output RMS")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("programs", [None, 1, 5, 1000])
def test_gpu_programs(programs):
    """Any program count: one program for everything, more programs than units."""
    from nsa_backend.kernels import mhc_gluon as G

    for m, splits in [(300, None), (1000, 4), (70, 16)]:
        a, b, d, sq = _inputs(m, 24, 7168, splits)
        G.tf32_hc_prenorm_gemm_gluon(a, b, d, sq, splits, programs=programs)
        _check(a, b, d, sq, splits, (m, splits, programs))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,splits", [(2048, None), (1024, 1), (4097, 16), (200, None)])
def test_gpu_cuda_graph(m, splits):
    """Captured once, replayed after the inputs change in place: the replays match eager calls and
    leave the arrival counters at zero."""
    from nsa_backend.kernels import mhc_gluon as G

    a, b, d, sq = _inputs(m, 24, 28672, splits)
    g, _ = capture(lambda: G.tf32_hc_prenorm_gemm_gluon(a, b, d, sq, splits))
    for seed in (1, 2, 3):
        a2, b2, _, _ = _inputs(m, 24, 28672, splits, seed=seed)
        a.copy_(a2)
        b.copy_(b2)
        d.fill_(float("nan"))
        sq.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(a, b, d, sq, splits, (m, splits, seed))
        d_e, sq_e = torch.empty_like(d), torch.empty_like(sq)
        G.tf32_hc_prenorm_gemm_gluon(a, b, d_e, sq_e, splits)
        assert torch.equal(d, d_e) and torch.equal(sq, sq_e)
    torch.cuda.synchronize()
    assert all(int(c.count_nonzero()) == 0 for c in G._COUNTERS.values())


@pytest.mark.gpu
@gpu
def test_gpu_route(monkeypatch):
    """The launcher takes the Gluon kernel where routed (same results as a direct call) and the ``tl``
    kernels with the route off or ``NSA_BACKEND_GLUON=0``."""
    from nsa_backend.kernels import mhc_gluon as G
    from nsa_backend.kernels._arch import device_arch
    from nsa_backend.mhc import tf32_hc_prenorm_gemm

    monkeypatch.setattr(cfgs, "GLUON_ENABLED", True)
    a, b, d, sq = _inputs(2048, 24, 28672, None)
    assert G.supported(a, b, None, device_arch(a.device))
    tf32_hc_prenorm_gemm(a, b, d, sq, impl="triton")
    d_g, sq_g = torch.empty_like(d), torch.empty_like(sq)
    G.tf32_hc_prenorm_gemm_gluon(a, b, d_g, sq_g, None)
    assert torch.equal(d, d_g) and torch.equal(sq, sq_g)
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    assert not G.supported(a, b, None, device_arch(a.device))
    tf32_hc_prenorm_gemm(a, b, d, sq, impl="triton")
    _check(a, b, d, sq, None, "tl route")
