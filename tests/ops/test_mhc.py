"""Tests of the mHC pre-norm GEMM ``tf32_hc_prenorm_gemm`` against ``nsa_backend.reference``.

CPU: the Triton kernels run in the interpreter on small shapes (every code path: 2-D and split
outputs, empty trailing splits, K chunked across programs, masked K tails, both precisions).
AOT: every shipped configuration compiles for every target architecture within its shared-memory
budget. GPU (``gpu`` mark): a fuzz over DeepSeek-V4 sized shapes against the fp32 reference.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from nsa_backend import reference
from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT, TARGET_ARCHS
from nsa_backend.mhc import tf32_hc_prenorm_gemm
from tests.conftest import HAS_GPU, has_triton
from tests.ops._aot import run_aot_script

pytestmark = pytest.mark.skipif(not has_triton(), reason="needs triton")

DEVICE = "cuda" if HAS_GPU else "cpu"
# Error bounds, relative to the RMS of the reference output: TF32 rounds b to a 10-bit mantissa.
# bf16x2 keeps 16 significant bits of b (TF32: 11).
TOL = {"tf32": 8e-3, "bf16x3": 2e-4, "bf16x2": 4e-4}


def _inputs(m: int, n: int, k: int, splits: int | None, device: str = DEVICE):
    a = torch.randn(m, k, device=device).to(torch.bfloat16)
    b = torch.randn(n, k, device=device)
    lead = () if splits is None else (splits,)
    d = torch.full((*lead, m, n), float("nan"), device=device)
    sq = torch.full((*lead, m), float("nan"), device=device)
    return a, b, d, sq


def _reference(a, b, d, sq, splits):
    d_ref, sq_ref = torch.empty_like(d), torch.empty_like(sq)
    reference.tf32_hc_prenorm_gemm(a, b, d_ref, sq_ref, splits)
    return d_ref, sq_ref


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().pow(2).mean().sqrt().clamp_min(1e-30)
    return ((x.float() - ref.float()).abs().max() / scale).item()


def _check(a, b, d, sq, splits, precision, case):
    d_ref, sq_ref = _reference(a, b, d, sq, splits)
    assert not d.isnan().any() and not sq.isnan().any(), f"unwritten outputs: {case}"
    err_d, err_sq = _rel_err(d, d_ref), _rel_err(sq, sq_ref)
    assert err_d < TOL[precision], f"d: {err_d=:.2e} {case}"
    assert err_sq < 1e-5, f"sqr_sum: {err_sq=:.2e} {case}"
    return err_d, err_sq


def _sm90_or_newer() -> bool:
    return HAS_GPU and torch.cuda.get_device_capability()[0] >= 9


def _launch(a, b, d, sq, splits, config, plan, precision, **flags):
    from nsa_backend.kernels import mhc as kern

    s = 1 if splits is None else splits
    m, n = a.shape[0], b.shape[0]
    kern._launch(a, b, d.view(s, m, n), sq.view(s, m), s, cfgs.block_n_for(n), config, plan, precision, **flags)


# (M, N, K, num_splits): odd M, every N bucket, an empty trailing split (K=320, S=4: 2+2+1+0 blocks).
PUBLIC_CASES = [
    pytest.param(1, 24, 128, None, id="M1-N24-K128"),  # decode, DeepSeek-V4 N
    pytest.param(37, 8, 256, None, id="M37-N8-K256"),
    pytest.param(70, 40, 192, 1, id="M70-N40-K192-S1"),
    pytest.param(19, 128, 128, None, id="M19-N128-K128"),
    pytest.param(23, 24, 320, 4, id="M23-N24-K320-S4"),
    pytest.param(130, 32, 448, 7, id="M130-N32-K448-S7"),
]


@pytest.mark.parametrize("m,n,k,splits", PUBLIC_CASES)
def test_public_op_matches_reference(m, n, k, splits):
    a, b, d, sq = _inputs(m, n, k, splits)
    tf32_hc_prenorm_gemm(a, b, d, sq, splits, impl="triton")
    _check(a, b, d, sq, splits, cfgs.DEFAULT_PRECISION, (m, n, k, splits))


# (M, N, K, num_splits, config, (split_k, chunk_k, num_chunks), precision): K cut into chunks (workspace
# and reduction kernel), BLOCK_K = 128 with masked K tails, the bf16x3 path.
KERNEL_CASES = [
    pytest.param(33, 24, 512, None, cfgs.GemmConfig(16, 64, 4, 2), (512, 128, 4), "tf32", id="chunks4"),
    pytest.param(40, 16, 576, 3, cfgs.GemmConfig(32, 128, 4, 2), (192, 128, 2), "tf32", id="S3-chunks2-K128tail"),
    pytest.param(17, 24, 320, 2, cfgs.GemmConfig(16, 128, 4, 2), (192, 128, 2), "bf16x3", id="bf16x3-S2-tail"),
    pytest.param(50, 64, 256, None, cfgs.GemmConfig(64, 64, 4, 2), (256, 256, 1), "bf16x3", id="bf16x3-N64"),
    pytest.param(3, 8, 4480, None, cfgs.GemmConfig(16, 64, 4, 2), (4480, 64, 70), "tf32", id="chunks70"),
    pytest.param(17, 24, 320, 2, cfgs.GemmConfig(16, 128, 4, 2), (192, 128, 2), "bf16x2",
                 id="bf16x2-S2-tail"),
]


@pytest.mark.parametrize("m,n,k,splits,config,plan,precision", KERNEL_CASES)
def test_kernel_paths(m, n, k, splits, config, plan, precision):
    a, b, d, sq = _inputs(m, n, k, splits)
    _launch(a, b, d, sq, splits, config, plan, precision)
    _check(a, b, d, sq, splits, precision, (m, n, k, splits, config, plan, precision))


# The stacked-parts path (b split by a first kernel, the three bf16 parts multiplied as one tile, 2-D
# square sums): one K chunk, chunks added by the reduction kernel, masked K tails, every N bucket it serves.
PARTS_CASES = [
    pytest.param(33, 24, 512, None, cfgs.GemmConfig(16, 64, 4, 2), (512, 128, 4), id="chunks4"),
    pytest.param(40, 16, 576, 3, cfgs.GemmConfig(32, 128, 4, 2), (192, 128, 2), id="S3-chunks2-K128tail"),
    pytest.param(70, 32, 256, None, cfgs.GemmConfig(64, 64, 4, 2), (256, 256, 1), id="one-chunk"),
    pytest.param(5, 8, 320, 2, cfgs.GemmConfig(16, 64, 4, 2), (192, 64, 3), id="S2-empty-tail"),
]


@pytest.mark.parametrize("atomic_sums", [False, True], ids=["sum-kernel", "atomic-sums"])
@pytest.mark.parametrize("precision", ["bf16x3", "bf16x2"])
@pytest.mark.parametrize("m,n,k,splits,config,plan", PARTS_CASES)
def test_b_parts_path(m, n, k, splits, config, plan, precision, atomic_sums):
    """Both part counts, chunks added by the reduction kernel or by atomics (into outputs that start
    as NaN: the split kernel must zero them); bf16x2 with programmatic dependent launch (on a GPU of
    sm_90+; in the interpreter the flag is ignored)."""
    a, b, d, sq = _inputs(m, n, k, splits)
    _launch(a, b, d, sq, splits, config, plan, precision, b_parts=True,
            pdl=precision == "bf16x2" and _sm90_or_newer(), atomic_sums=atomic_sums)
    _check(a, b, d, sq, splits, precision, (m, n, k, splits, config, plan, atomic_sums))


def test_b_parts_route():
    """The stacked parts serve bf16x3, N in 17..32 and M above the small tiles on the archs measured."""
    for arch in TARGET_ARCHS:
        for n, m in ((24, 1024), (32, 65), (24, 64), (8, 4096), (128, 4096)):
            block_n = cfgs.block_n_for(n)
            want = arch in cfgs.PARTS_ARCHS and block_n == cfgs.PARTS_BLOCK_N and m > cfgs.SMALL_BLOCK_M[-1]
            assert cfgs.uses_b_parts(block_n, m, arch) == want
            assert not cfgs.uses_b_parts(block_n, m, arch, "tf32")
    assert not cfgs.uses_b_parts(32, 4096, None)  # CPU interpreter: the route of the public op stays the fp32 b


@pytest.mark.parametrize("gluon_on", [True, False], ids=["gluon", "no-gluon"])
@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_gluon_parts_route(monkeypatch, arch, gluon_on):
    """The stacked-parts GEMM is the Gluon kernel, with its own tile and K plan, exactly on the mma.sync
    archs where Gluon may run; every other launch keeps the ``tl`` route."""
    from nsa_backend.kernels import mhc as kern
    from nsa_backend.kernels.mhc import sm80_gluon

    monkeypatch.setattr(kern, "_arch_and_sms", lambda device: (arch, 132))
    monkeypatch.setattr(sm80_gluon, "gluon_enabled", lambda a, archs: gluon_on and a in archs)
    kern._plan.cache_clear()
    try:
        for m, n, k, splits in ((2048, 24, 28672, 1), (16384, 32, 7168, 4), (64, 24, 28672, 1), (4096, 128, 7168, 1)):
            _, cfg, plan, b_parts, gluon = kern._plan(m, n, k, splits, None, gluon_on)
            want = gluon_on and b_parts and arch in cfgs.GLUON_PARTS_ARCHS
            assert gluon == want, (arch, m, n)
            if gluon:
                assert (cfg, plan[:2]) == (cfgs.GLUON_PARTS_ROUTE[0], kern.split_plan(
                    m, n, k, splits, cfg.block_m, cfg.block_k, 132, cfgs.GLUON_PARTS_ROUTE[1])[:2])
                assert plan[0] % cfg.block_k == 0 and plan[1] % cfg.block_k == 0
            elif b_parts:
                assert cfg == cfgs.parts_route(m, arch)[0]
    finally:
        kern._plan.cache_clear()


def test_gluon_variants_shipped():
    """The ahead-of-time variants hold the Gluon GEMM (chunks stored and added by atomics) exactly for the
    mma.sync archs, where this Triton has Gluon."""
    from nsa_backend.kernels import mhc as kern
    from nsa_backend.kernels._gluon import gluon_importable

    for arch in TARGET_ARCHS:
        labels = [v.label for v in kern.shipped_variants(arch) if "gluon" in v.label]
        want = 2 if arch in cfgs.GLUON_PARTS_ARCHS and gluon_importable() else 0
        assert len(labels) == want, (arch, labels)


def test_product_waited_for_only_where_it_is_asynchronous(monkeypatch):
    """``SYNC_MMA`` where tl.dot is asynchronous (wgmma on sm_90, tcgen05 on sm_100 / 103); not on the mma.sync
    archs, nor on sm_90 with Triton's Hopper MMA off (the proxy), nor in the interpreter; the ahead-of-time
    variants of each arch and the launches follow the same rule."""
    from nsa_backend import envs
    from nsa_backend.kernels import mhc as kern

    assert [cfgs.sync_mma(c) for c in (80, 86, 89, 120, 121, None)] == [False] * 6
    assert [cfgs.sync_mma(c) for c in (90, 100, 103)] == [True] * 3
    assert not cfgs.sync_mma(90, mma_v3_disabled=True) and cfgs.sync_mma(100, mma_v3_disabled=True)
    for arch in TARGET_ARCHS:
        parts = [v for v in kern.shipped_variants(arch) if v.kind == "gemm" and v.constexprs.get("B_PARTS")]
        assert all(v.constexprs["SYNC_MMA"] == cfgs.sync_mma(arch) for v in parts), arch
    for value, disabled in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("", False)):
        monkeypatch.setenv("DISABLE_MMA_V3", value)
        assert envs.triton_mma_v3_disabled() is disabled


def test_split_b_is_exact():
    """hi + mid + lo reproduces b exactly (24 significant bits) for normal fp32 values."""
    from nsa_backend.kernels import mhc as kern

    b = torch.randn(8, 640, device=DEVICE) * torch.logspace(-20, 20, 640, device=DEVICE)
    parts = kern._split_b(b)
    assert parts.shape == (3, 8, 640) and parts.dtype == torch.bfloat16
    assert torch.equal(parts.double().sum(0), b.double())


def test_split_b_two_parts():
    """bf16x2: hi + lo keeps 16 significant bits of b (|error| <= 2^-16 |b| when rounded to nearest as on
    the GPU, 2^-15 when truncated as in the CPU interpreter)."""
    from nsa_backend.kernels import mhc as kern

    b = torch.randn(8, 640, device=DEVICE) * torch.logspace(-20, 20, 640, device=DEVICE)
    parts = kern._split_b(b, "bf16x2")
    assert parts.shape == (2, 8, 640) and parts.dtype == torch.bfloat16
    err = (parts.double().sum(0) - b.double()).abs()
    assert (err <= b.double().abs() * 2.0 ** (-15 if DEVICE == "cpu" else -16)).all()


def test_splits_match_reference_partition():
    """Split s holds exactly the K range split_bounds(K, S)[s] (compared split by split)."""
    m, n, k, splits = 9, 8, 640, 4
    a, b, d, sq = _inputs(m, n, k, splits)
    _launch(a, b, d, sq, splits, cfgs.GemmConfig(16, 64, 4, 2), (192, 64, 3), "tf32")
    for s, (k0, k1) in enumerate(reference.split_bounds(k, splits)):
        d_s = a[:, k0:k1].float() @ b[:, k0:k1].T
        assert torch.allclose(d[s], d_s, rtol=1e-4, atol=1e-3), f"split {s}"
        assert torch.allclose(sq[s], a[:, k0:k1].float().pow(2).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("precision,b_parts", [("tf32", False), ("bf16x3", False), ("bf16x3", True),
                                              ("bf16x2", True)])
def test_deterministic(precision, b_parts):
    a, b, d, sq = _inputs(29, 24, 384, None)
    plan = (384, 128, 3)
    _launch(a, b, d, sq, None, cfgs.GemmConfig(16, 64, 4, 2), plan, precision, b_parts=b_parts)
    d2, sq2 = torch.empty_like(d), torch.empty_like(sq)
    _launch(a, b, d2, sq2, None, cfgs.GemmConfig(16, 64, 4, 2), plan, precision, b_parts=b_parts)
    assert torch.equal(d, d2) and torch.equal(sq, sq2)


def test_atomic_sums_follow_deterministic_mode(monkeypatch):
    """The implementation asks for atomic chunk sums unless torch's deterministic mode is on (or
    ``ATOMIC_CHUNK_SUMS`` is off)."""
    from nsa_backend.kernels import mhc as kern

    seen = []
    monkeypatch.setattr(kern, "_launch", lambda *args, **kwargs: seen.append(args[-1]))
    a, b, d, sq = _inputs(8, 24, 128, None)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        kern.tf32_hc_prenorm_gemm_triton(a, b, d, sq)
        torch.use_deterministic_algorithms(True)
        kern.tf32_hc_prenorm_gemm_triton(a, b, d, sq)
    finally:
        torch.use_deterministic_algorithms(before)
    monkeypatch.setattr(cfgs, "ATOMIC_CHUNK_SUMS", False)
    kern.tf32_hc_prenorm_gemm_triton(a, b, d, sq)
    assert seen == [True, False, False]


@pytest.mark.parametrize("m,k,splits,sms", [(1, 28672, 1, 132), (1024, 28672, 1, 132), (8192, 7168, 16, 132),
                                            (16384, 28672, 1, 170), (3, 64, 1, 8), (5, 320, 4, 8)])
def test_split_plan_covers_each_split(m, k, splits, sms):
    from nsa_backend.kernels.mhc import split_plan

    split_k, chunk_k, chunks = split_plan(m, 24, k, splits, 128, 64, sms)
    bounds = reference.split_bounds(k, splits)
    assert split_k % 64 == 0 and chunk_k % 64 == 0
    for s, (k0, k1) in enumerate(bounds):
        assert k0 == min(s * split_k, k) and k1 == min((s + 1) * split_k, k)
    assert chunks * chunk_k >= split_k > (chunks - 1) * chunk_k
    assert chunks == 1 or chunk_k >= min(cfgs.MIN_CHUNK_K, split_k)


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_config_choice_fits_estimate(arch):
    for n in range(8, 129, 8):
        for m in (1, 16, 17, 64, 65, 16384):
            block_n, cfg = cfgs.gemm_config(n, m, arch)
            assert block_n >= n and cfg.block_m >= min(m, 16)
            b_parts = cfgs.uses_b_parts(block_n, m, arch)
            precision = cfgs.PARTS_PRECISION if b_parts else cfgs.DEFAULT_PRECISION
            assert cfg.shared_bytes_estimate(block_n, b_parts, precision) <= SHARED_MEMORY_LIMIT[arch]


def test_aot_variants_are_the_launched_ones():
    """The ahead-of-time compiles of each shipped tile cover the ``EVEN_K`` value its launches take (the
    kernel's own heuristic) on the DeepSeek-V4 shapes and on a K that is not a multiple of 128."""
    from nsa_backend.kernels import mhc as kern

    even_k = kern._mhc_prenorm_gemm_kernel.values["EVEN_K"]
    seen = set()
    for arch in TARGET_ARCHS:
        for _, cfg, b_parts in cfgs.shipped_configs(arch):
            per_sm = cfgs.PROGRAMS_PER_SM
            if b_parts:
                per_sm = next(per for _, tile, per in cfgs.PARTS_ARCH_ROUTES[arch] if tile == cfg)
            for m, k, splits in ((4096, 28672, 1), (2048, 7168, 1), (1024, 28672, 16), (4096, 7232, 1)):
                split_k, chunk_k, _ = kern.split_plan(m, 24, k, splits, cfg.block_m, cfg.block_k, 132, per_sm)
                launched = even_k({"K": k, "BLOCK_K": cfg.block_k, "SPLIT_K": split_k, "CHUNK_K": chunk_k})
                assert launched in kern.even_k_variants(cfg.block_k), (arch, cfg, m, k, splits)
                seen.add(launched)
    assert seen == {True, False}  # both kinds of launch occur among the shipped tiles


_AOT_SCRIPT = """
import json, sys
from concurrent.futures import ProcessPoolExecutor
def one(arch):
    from nsa_backend.kernels import mhc
    return [(c.name, c.arch, c.shared_bytes, c.num_warps, c.num_stages)
            for c in mhc.compile_shipped(arch)]
with ProcessPoolExecutor(2) as ex:
    print(json.dumps([r for rs in ex.map(one, json.loads(sys.argv[1])) for r in rs]))
"""


_AOT_VARIANTS_SCRIPT = """
import json
from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels import mhc
rows = []
for arch in (90, 100):
    cfg = cfgs.PARTS_ROUTES[0][1]
    for precision, atomic_sums in (("bf16x3", False), ("bf16x2", False), ("bf16x3", True), ("bf16x2", True)):
        sig, cx = mhc._gemm_variant(cfgs.PARTS_BLOCK_N, cfg, precision, True, pdl=True, atomic_sums=atomic_sums)
        c = mhc._compile(mhc._mhc_prenorm_gemm_kernel.fn, sig, mhc._GEMM_DIVISIBLE, cx, arch, cfg.num_warps,
                         cfg.num_stages)
        rows.append((c.name, c.arch, c.shared_bytes))
    for parts, zero_out in ((2, False), (3, True)):
        c = mhc._compile(mhc._mhc_prenorm_split_b_kernel, mhc._SPLIT_B_SIGNATURE, mhc._SPLIT_B_DIVISIBLE,
                         {"NUM_PARTS": parts, "BLOCK": cfgs.SPLIT_B_BLOCK, "USE_PDL": True, "ZERO_OUT": zero_out},
                         arch, 4, 3)
        rows.append((c.name, c.arch, c.shared_bytes))
    c = mhc._compile(mhc._mhc_prenorm_reduce_kernel, mhc._REDUCE_SIGNATURE, mhc._REDUCE_DIVISIBLE,
                     {"BLOCK": 256, "BLOCK_J": 16, "USE_PDL": True}, arch, 4, 3)
    rows.append((c.name, c.arch, c.shared_bytes))
print(json.dumps(rows))
"""


_AOT_SYNC_SCRIPT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels import mhc
rows = []
for arch, (_, cfg, _), even_k, atomic_sums in [
        (arch, route, even_k, atomic_sums) for arch in cfgs.PARTS_ARCHS if arch // 10 == 9
        for route in cfgs.PARTS_ARCH_ROUTES[arch]
        for even_k in (False, True) for atomic_sums in (False, True)]:
    sig, cx = mhc._gemm_variant(cfgs.PARTS_BLOCK_N, cfg, cfgs.PARTS_PRECISION, True, mhc._pdl_enabled(arch),
                                atomic_sums)
    cx["EVEN_K"] = even_k
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in mhc._GEMM_DIVISIBLE}
    src = ASTSource(fn=mhc._mhc_prenorm_gemm_kernel.fn, signature=sig, constexprs=cx, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    rows.append((arch, [int(p) for p in re.findall(r"pendings = (\\d+)", c.asm["ttgir"])]))
print(json.dumps(rows))
"""


def test_aot_parts_product_waited_in_its_step():
    """The stacked-parts GEMM as shipped for sm_90 (every tile of ``PARTS_ROUTES``, with and without
    masked K tails) keeps no tensor-core product in flight across a step (every wait on it has no
    pending product): the next step's loads may reuse the a buffer it reads (see ``SYNC_MMA`` in
    ``nsa_backend.configs.mhc``)."""
    rows = run_aot_script(_AOT_SYNC_SCRIPT, timeout=600)
    assert rows and all(pendings and not any(pendings) for _, pendings in rows), rows


def test_aot_compile_parts_variants():
    """Both part counts, chunks stored or added by atomics, with programmatic dependent launch compile
    for sm_90 / sm_100."""
    rows = run_aot_script(_AOT_VARIANTS_SCRIPT, timeout=900)
    assert len(rows) == 2 * (4 + 2 + 1)
    assert all(r[2] <= SHARED_MEMORY_LIMIT[r[1]] for r in rows), rows


def test_aot_compile_all_archs():
    """Every shipped configuration compiles for sm_80..sm_121 within the shared-memory limit."""
    rows = run_aot_script(_AOT_SCRIPT, json.dumps(list(TARGET_ARCHS)), timeout=900)
    assert {r[1] for r in rows} == set(TARGET_ARCHS)
    too_big = [r for r in rows if r[2] > SHARED_MEMORY_LIMIT[r[1]]]
    assert not too_big, f"over the shared-memory limit: {too_big}"


# GPU fuzz: M in 1..8192, N in {8, 24, 32, 128}, K in {7168, 28672}, splits None/1/4/16.
FUZZ_CASES = 240
FUZZ_CASES_B_PARTS = 300


def _fuzz_shapes(count: int, seed: int = 1234):
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        m = round(2 ** rng.uniform(0, 13)) if i % 8 else rng.choice([1, 2, 7, 64, 1024, 4096, 8192])
        shapes.append((max(1, min(m, 8192)), rng.choice([8, 24, 32, 128]), rng.choice([7168, 28672]),
                       rng.choice([None, 1, 4, 16])))
    return shapes


@pytest.mark.gpu
def test_gpu_fuzz_b_parts():
    """300 shapes the stacked-parts route serves (N 17..32, M above the small tiles), through the
    public op with the arch's routed tiles (skipped where the arch has no such route)."""
    from nsa_backend.kernels import mhc as kern

    torch.backends.cuda.matmul.allow_tf32 = False
    arch, _ = kern._arch_and_sms(torch.device("cuda"))
    if arch not in cfgs.PARTS_ARCHS:
        pytest.skip(f"the stacked-parts path is routed on sm_{cfgs.PARTS_ARCHS}, not sm_{arch}")
    rng = random.Random(4321)
    errs = []
    for _ in range(FUZZ_CASES_B_PARTS):
        m, n = round(2 ** rng.uniform(6.03, 13.3)), rng.choice([24, 32])
        k, splits = rng.choice([7168, 28672]), rng.choice([None, 1, 4, 16])
        assert cfgs.uses_b_parts(cfgs.block_n_for(n), m, arch)
        a, b, d, sq = _inputs(m, n, k, splits, "cuda")
        tf32_hc_prenorm_gemm(a, b, d, sq, splits, impl="triton")
        errs.append(_check(a, b, d, sq, splits, cfgs.PARTS_PRECISION, (m, n, k, splits)))
    worst_d, worst_sq = max(e[0] for e in errs), max(e[1] for e in errs)
    print(f"mhc stacked-parts fuzz on sm_{arch}: {len(errs)} cases, max error d {worst_d:.2e}, "
          f"sqr_sum {worst_sq:.2e} (of the output RMS)")


@pytest.mark.gpu
def test_gpu_fuzz():
    torch.backends.cuda.matmul.allow_tf32 = False
    errs = []
    for m, n, k, splits in _fuzz_shapes(FUZZ_CASES):
        a, b, d, sq = _inputs(m, n, k, splits, "cuda")
        tf32_hc_prenorm_gemm(a, b, d, sq, splits, impl="triton")
        errs.append(_check(a, b, d, sq, splits, cfgs.DEFAULT_PRECISION, (m, n, k, splits)))
    worst_d, worst_sq = max(e[0] for e in errs), max(e[1] for e in errs)
    print(f"mhc fuzz: {len(errs)} cases, max error d {worst_d:.2e}, sqr_sum {worst_sq:.2e} (of the output RMS)")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", cfgs.PRECISIONS)
def test_gpu_precision_error(precision):
    """Error of each precision on the DeepSeek-V4 shape (printed for the docs)."""
    from nsa_backend.kernels import mhc as kern

    torch.backends.cuda.matmul.allow_tf32 = False
    m, n, k = 2048, 24, 28672
    a, b, d, sq = _inputs(m, n, k, None, "cuda")
    arch, sms = kern._arch_and_sms(a.device)
    block_n, cfg = cfgs.gemm_config(n, m, arch, precision)
    b_parts = cfgs.uses_b_parts(block_n, m, arch, precision)
    per_sm = cfgs.parts_route(m, arch)[1] if b_parts else cfgs.PROGRAMS_PER_SM
    plan = kern.split_plan(m, n, k, 1, cfg.block_m, cfg.block_k, sms, per_sm)
    if b_parts:  # the precision the stacked-parts path runs
        precision = cfgs.PARTS_PRECISION
    _launch(a, b, d, sq, None, cfg, plan, precision, b_parts=b_parts, pdl=b_parts and kern._pdl_enabled(arch))
    err_d, _ = _check(a, b, d, sq, None, precision, precision)
    d64 = a.double() @ b.double().T
    diff = 1 - 2 * (d.double() * d64).sum() / (d.double().pow(2) + d64.pow(2)).sum()
    print(f"mhc {precision} (b_parts={b_parts}): max error {err_d:.2e} of the output RMS, "
          f"calc_diff vs fp64 {diff.item():.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,splits", [(1024, None), (2048, None), (1025, 4)])
def test_gpu_deterministic(m, splits):
    """Under ``torch.use_deterministic_algorithms(True)`` the public op is bit-identical from call to
    call (the chunks are added by the fixed-order kernel, not by atomics); without it, the results
    agree to the fp32 rounding of the additions."""
    a, b, d, sq = _inputs(m, 24, 28672, splits, "cuda")
    d2, sq2 = torch.empty_like(d), torch.empty_like(sq)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        tf32_hc_prenorm_gemm(a, b, d, sq, splits, impl="triton")
        tf32_hc_prenorm_gemm(a, b, d2, sq2, splits, impl="triton")
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(d, d2) and torch.equal(sq, sq2)
    _check(a, b, d, sq, splits, cfgs.PARTS_PRECISION, (m, splits, "deterministic"))
    tf32_hc_prenorm_gemm(a, b, d2, sq2, splits, impl="triton")
    assert torch.allclose(d, d2, rtol=1e-5, atol=1e-4) and torch.allclose(sq, sq2, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("atomic_sums", [False, True], ids=["sum-kernel", "atomic-sums"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("m,n,k,splits", [(1024, 24, 28672, None), (999, 24, 7168, None), (4096, 32, 28672, 4),
                                          (16384, 24, 28672, None), (65, 24, 28672, 16), (3001, 24, 7168, 1),
                                          (2048, 24, 28672, None), (1500, 32, 7168, 5), (1025, 24, 28672, 16),
                                          (3500, 24, 7168, 5)])
def test_gpu_b_parts_path(m, n, k, splits, pdl, atomic_sums):
    """The stacked-parts path with its shipped tile, precision and K plan, launched plainly and
    with programmatic dependent launch (sm_90+), chunks added by the reduction kernel or by atomics,
    eagerly and as a CUDA graph into NaN-filled outputs (compared and repeated: bit-identical with the
    reduction kernel, equal to the fp32 rounding of the additions with atomics)."""
    from nsa_backend.kernels import mhc as kern

    torch.backends.cuda.matmul.allow_tf32 = False
    a, b, d, sq = _inputs(m, n, k, splits, "cuda")
    arch, sms = kern._arch_and_sms(a.device)
    if arch not in cfgs.PARTS_ARCHS:
        pytest.skip(f"the stacked-parts path is routed on sm_{cfgs.PARTS_ARCHS}, not sm_{arch}")
    s = 1 if splits is None else splits
    cfg, per_sm = cfgs.parts_route(m, arch)
    plan = kern.split_plan(m, n, k, s, cfg.block_m, cfg.block_k, sms, per_sm)

    def run(d_out, sq_out):
        _launch(a, b, d_out, sq_out, splits, cfg, plan, cfgs.PARTS_PRECISION, b_parts=True, pdl=pdl,
                atomic_sums=atomic_sums)

    def same(x, y):
        return torch.equal(x, y) if not atomic_sums else torch.allclose(x, y, rtol=1e-5, atol=1e-4)

    run(d, sq)
    _check(a, b, d, sq, splits, cfgs.PARTS_PRECISION, (m, n, k, splits, plan, pdl, atomic_sums))
    d2, sq2 = torch.full_like(d, float("nan")), torch.full_like(sq, float("nan"))
    run(d2, sq2)
    assert same(d, d2) and same(sq, sq2)
    d2.fill_(float("nan"))
    sq2.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    run(d2, sq2)  # warm-up: compiled before capture
    with torch.cuda.graph(graph):
        run(d2, sq2)
    d2.fill_(float("nan"))
    sq2.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert same(d, d2) and same(sq, sq2)


# The Gluon stacked-parts GEMM on its own (any sm_80+ GPU with Gluon; under the sm120 proxy the public op
# routes to it as well): one chunk, chunks stored for the reduction kernel or added by atomics, splits with an
# empty trailing one, M tails, N 17..32.
GLUON_CASES = [(1024, 24, 28672, None), (999, 24, 7168, None), (4096, 32, 28672, 4), (16384, 24, 28672, None),
               (65, 24, 28672, 16), (3001, 17, 7168, 1), (2048, 24, 28672, None), (1500, 32, 7168, 5),
               (200, 24, 320 * 64, 7), (130, 24, 448, 7)]


def _on_gluon_gpu() -> bool:
    from nsa_backend.kernels._gluon import gluon_importable

    return HAS_GPU and torch.cuda.get_device_capability()[0] >= 8 and gluon_importable()


def _gluon_run(a, b, d, sq, splits, atomic_sums, plan=None):
    from nsa_backend.kernels import mhc as kern

    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    cfg, per_sm = cfgs.GLUON_PARTS_ROUTE
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    plan = plan or kern.split_plan(m, n, k, 1 if splits is None else splits, cfg.block_m, cfg.block_k, sms, per_sm)
    _launch(a, b, d, sq, splits, cfg, plan, "bf16x2", b_parts=True, atomic_sums=atomic_sums, gluon=True)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("atomic_sums", [False, True], ids=["sum-kernel", "atomic-sums"])
@pytest.mark.parametrize("m,n,k,splits", GLUON_CASES)
def test_gpu_gluon_parts_path(m, n, k, splits, atomic_sums):
    """The Gluon GEMM with its shipped tile and K plan, eagerly and as a CUDA graph into NaN-filled outputs
    (compared and repeated: bit-identical with the reduction kernel, equal to the fp32 rounding of the
    additions with atomics)."""
    if not _on_gluon_gpu():
        pytest.skip("needs an sm_80+ GPU and a Triton with Gluon")
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b, d, sq = _inputs(m, n, k, splits, "cuda")
    plan = _gluon_run(a, b, d, sq, splits, atomic_sums)
    _check(a, b, d, sq, splits, "bf16x2", (m, n, k, splits, plan, atomic_sums))

    def same(x, y):
        return torch.equal(x, y) if not atomic_sums else torch.allclose(x, y, rtol=1e-5, atol=1e-4)

    d2, sq2 = torch.full_like(d, float("nan")), torch.full_like(sq, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _gluon_run(a, b, d2, sq2, splits, atomic_sums, plan)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert same(d, d2) and same(sq, sq2)


@pytest.mark.gpu
def test_gpu_fuzz_gluon_parts():
    """300 shapes of the stacked-parts route (N 17..32, M 65..10000, splits) through the Gluon GEMM, its
    chunks added by atomics as the public op adds them."""
    if not _on_gluon_gpu():
        pytest.skip("needs an sm_80+ GPU and a Triton with Gluon")
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(2468)
    errs = []
    for _ in range(FUZZ_CASES_B_PARTS):
        m, n = round(2 ** rng.uniform(6.03, 13.3)), rng.choice([17, 24, 32])
        k, splits = rng.choice([7168, 28672, 64 * rng.randint(1, 64)]), rng.choice([None, 1, 4, 16])
        a, b, d, sq = _inputs(m, n, k, splits, "cuda")
        _gluon_run(a, b, d, sq, splits, True)
        errs.append(_check(a, b, d, sq, splits, "bf16x2", (m, n, k, splits)))
    worst_d, worst_sq = max(e[0] for e in errs), max(e[1] for e in errs)
    print(f"mhc Gluon stacked-parts fuzz: {len(errs)} cases, max error d {worst_d:.2e}, sqr_sum {worst_sq:.2e} "
          "(of the output RMS)")
