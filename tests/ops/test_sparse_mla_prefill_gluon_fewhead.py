"""Few-head Gluon sparse MLA prefill (sm_90, ``h_q <= 32``) against ``nsa_backend.reference``.

CPU: the dispatch gate (never taken off CUDA or in the interpreter), the launch plan (head block,
slots, programs) and its validation, and an ahead-of-time compile of both head blocks for sm_90
within the 227 KiB of shared memory and without register spills (skipped when the installed Triton
has no usable Gluon).
GPU (sm_90 with Gluon): a seeded fuzz against the fp32 reference (h_q 1..32, topk 1..4096, invalid
indices -1 / >= s_kv / other negatives, attn_sink, topk_length with empty rows, plan overrides), rows
walked by fewer programs than rows, and the benchmark shape against the ``tl`` kernel.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

from tests.ops._aot import run_aot_script
from tests.ops._gluon import on_sm90_gluon
from tests.ops.test_sparse_mla import _check_stat, prefill_case, run_prefill_case

triton = pytest.importorskip("triton")



def test_gate_off_without_cuda():
    from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon_fewhead as F

    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    assert not F.supported(q, kv, 512, None)
    assert F.GLUON_ARCHS == (90,)


def test_plan():
    from nsa_backend.kernels.sparse_mla_prefill.sm90_gluon_fewhead import PLANS, FewheadPlan, fewhead_plan

    for h_q, bh in ((1, 16), (16, 16), (17, 32), (32, 32)):
        p = fewhead_plan(4096, h_q)
        assert p == FewheadPlan(bh, *PLANS[bh][:2], 4096, *PLANS[bh][2:])
    assert fewhead_plan(5, 16, programs=264).programs == 5
    p = fewhead_plan(4096, 16, programs=132, slots=11, rope_stages=2, maxnreg=None, loader_warps=2, loader_regs=40)
    assert p == FewheadPlan(16, 11, 2, 132, None, 2, 40)
    for bad in (0, 33, 64):
        with pytest.raises(ValueError):
            fewhead_plan(16, bad)
    for kw in (dict(slots=3), dict(slots=8, rope_stages=1), dict(slots=12, rope_stages=2), dict(rope_stages=3),
               dict(loader_warps=3), dict(loader_regs=20), dict(loader_regs=60)):
        with pytest.raises(ValueError):
            fewhead_plan(16, 16, **kw)


_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels._gluon import gluon_importable
    rows = []
    if gluon_importable():
        from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon_fewhead as F
        for bh in (16, 32):
            k = F.compile_for_sm90(bh)  # the shipped plan of each head block
            try:
                spills = k.asm["sass"].count("STL ")
            except Exception:  # no disassembler: shared memory only
                spills = 0
            rows.append([bh, int(k.metadata.shared), spills])
    print(json.dumps(rows))
""")


def test_aot_sm90_fits_shared_memory():
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    if not gluon_importable():
        pytest.skip("this Triton has no usable Gluon")
    rows = run_aot_script(_AOT_SCRIPT, timeout=600)
    assert [r[0] for r in rows] == [16, 32]
    # the 32-head block keeps 128 accumulator registers per thread under a launch cap of 128 (232 for
    # its compute warpgroup): ptxas spills a few values (14 local-memory stores with Triton 3.6, 5 with 3.9)
    spill_limit = {16: 0, 32: 24}
    for bh, shared, spills in rows:
        assert 0 < shared <= SHARED_MEMORY_LIMIT[90], f"block_h {bh}: {shared} B shared"
        assert spills <= spill_limit[bh], f"block_h {bh}: {spills} local-memory stores"


def _fuzz_cases(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        cases.append(dict(
            s_q=rnd.randint(1, 6),
            h_q=rnd.choice([1, 3, 8, 16, 17, 20, 24, 32]),
            d_qk=576,
            s_kv=rnd.choice([1, 50, 777, 4096, 20000]),
            topk=rnd.choice([1, 7, 64, 100, 333, 1024, 2048, 4096]),
            frac_invalid=rnd.choice([0.0, 0.05, 0.5, 0.95, 1.0]),
            sink=rnd.random() < 0.5,
            topk_len=rnd.random() < 0.5,
            seed=i,
        ))
    return cases


def _run(a: dict, case: str, **plan) -> float:
    from nsa_backend.kernels.sparse_mla_prefill.sm90_gluon_fewhead import flash_mla_sparse_fwd_gluon_fewhead

    return run_prefill_case(a, case, prefill=flash_mla_sparse_fwd_gluon_fewhead, **plan)


@pytest.mark.gpu
def test_fewhead_prefill_gpu_fuzz():
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    rnd = random.Random(1)
    errs = []
    for c in _fuzz_cases(100):
        plan = rnd.choice([{}, {}, {"programs": 1}, {"programs": 3}, {"slots": 4, "rope_stages": 2, "programs": 2}])
        errs.append(_run(prefill_case(**c), f"{c} {plan}", **plan))
    print(f"few-head gluon prefill fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
def test_fewhead_prefill_many_rows_gpu():
    """Rows walked by fewer programs than rows, ``topk_length`` 0 .. topk + 3 (empty rows between full
    ones), a sink, both head blocks."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    for h_q, s_q, programs in ((16, 300, None), (32, 517, None), (12, 401, 7), (32, 64, 1)):
        a = prefill_case(s_q, h_q, 576, 3000, 192, 0.2, True, True, seed=s_q)
        a["topk_length"][::7] = 0
        _run(a, f"many rows h_q={h_q} s_q={s_q} programs={programs}", programs=programs)


@pytest.mark.gpu
def test_fewhead_prefill_bench_shape_matches_tl():
    """A slice of the benchmark shape (topk 2048, s_kv 32768): few-head kernel, ``tl`` kernel and reference
    agree."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.configs.sparse_mla import heads_per_program, prefill_config
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton
    from nsa_backend.kernels.sparse_mla_prefill.sm90_gluon_fewhead import flash_mla_sparse_fwd_gluon_fewhead

    for h_q in (16, 32):
        a = prefill_case(16, h_q, 576, 32768, 2048, 0.0, False, False, seed=h_q)
        err = _run(a, f"bench slice h_q={h_q}")
        out_tl, mx_tl, lse_tl = flash_mla_sparse_fwd_triton(**a, config=prefill_config(heads_per_program(h_q, 90), 90))
        out_g, mx_g, lse_g = flash_mla_sparse_fwd_gluon_fewhead(**a)
        assert (out_g.float() - out_tl.float()).abs().max().item() <= 4 * max(err, 2**-8)
        _check_stat("lse", lse_g, lse_tl, "few-head vs tl")
        _check_stat("max_logits", mx_g, mx_tl, "few-head vs tl")


@pytest.mark.gpu
def test_fewhead_prefill_route_gpu():
    """The prefill launcher takes the few-head kernel for h_q <= 32 when it is enabled."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon_fewhead as F

    a = prefill_case(3, 16, 576, 500, 100, 0.1, True, True, seed=3)
    assert F.supported(a["q"], a["kv"], 512, 90) == F.ENABLED
    assert not F.supported(prefill_case(1, 64, 576, 50, 8, 0.0, False, False, seed=0)["q"], a["kv"], 512, 90)
    run_prefill_case(a, "launcher h_q=16")
