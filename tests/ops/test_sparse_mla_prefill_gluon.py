"""Gluon sparse MLA prefill (sm_90) against ``nsa_backend.reference``.

CPU: the dispatch gate (never taken off CUDA or in the interpreter) and an ahead-of-time compile for
sm_90 within the 227 KiB of shared memory (skipped when the installed Triton has
no usable Gluon).
GPU (sm_90 with Gluon): a seeded fuzz against the fp32 reference (h_q 64 / 128 / 192 and padded head
blocks 20 / 32 / 96, topk 1..4096, invalid indices -1 / >= s_kv / other negatives, attn_sink,
topk_length with empty rows), several waves of programs, and the prefill
launcher's dispatch against the ``tl`` kernel.
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
    from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon as G

    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    assert not G.supported(q, kv, 512, None)
    assert G.GLUON_ARCHS == (90,)


_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels._gluon import gluon_importable
    rows = []
    if gluon_importable():
        from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon as G
        rows.append(int(G.compile_for_sm90().metadata.shared))
    print(json.dumps(rows))
""")


def test_aot_sm90_fits_shared_memory():
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    if not gluon_importable():
        pytest.skip("this Triton has no usable Gluon")
    (shared,) = run_aot_script(_AOT_SCRIPT, timeout=600)
    assert 0 < shared <= SHARED_MEMORY_LIMIT[90], f"{shared} B shared"


def _fuzz_cases(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        topk = rnd.choice([1, 7, 64, 100, 333, 1024, 2048, 4096])
        cases.append(dict(
            s_q=rnd.randint(1, 5),
            h_q=rnd.choice([64, 128, 192, 20, 32, 96]),
            d_qk=576,
            s_kv=rnd.choice([1, 50, 777, 4096, 20000]),
            topk=topk,
            frac_invalid=rnd.choice([0.0, 0.05, 0.5, 0.95, 1.0]),
            sink=rnd.random() < 0.5,
            topk_len=rnd.random() < 0.5,
            seed=i,
        ))
    return cases


def _run(a: dict, case: str) -> float:
    from nsa_backend.kernels.sparse_mla_prefill.sm90_gluon import flash_mla_sparse_fwd_gluon

    return run_prefill_case(a, case, prefill=flash_mla_sparse_fwd_gluon)


@pytest.mark.gpu
def test_gluon_prefill_gpu_fuzz():
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    errs = [_run(prefill_case(**c), f"{c}") for c in _fuzz_cases(100)]
    print(f"gluon prefill fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
def test_gluon_prefill_many_rows_gpu():
    """Several waves of programs with ``topk_length`` 0 .. topk + 3 (empty rows between full ones), a
    sink and padded head blocks (h_q 32)."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    for h_q, s_q in ((128, 300), (64, 517), (32, 401)):
        a = prefill_case(s_q, h_q, 576, 3000, 192, 0.2, True, True, seed=s_q)
        a["topk_length"][::7] = 0
        _run(a, f"many rows h_q={h_q} s_q={s_q}")


@pytest.mark.gpu
def test_gluon_prefill_bench_shape_matches_tl():
    """A slice of the benchmark shape (topk 2048, s_kv 32768): Gluon, ``tl`` kernel and reference agree."""
    if not on_sm90_gluon():
        pytest.skip("needs sm_90 and Gluon")
    from nsa_backend.configs.sparse_mla import prefill_config
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

    for h_q in (64, 128):
        a = prefill_case(16, h_q, 576, 32768, 2048, 0.0, False, False, seed=h_q)
        err = _run(a, f"bench slice h_q={h_q}")
        out_tl, mx_tl, lse_tl = flash_mla_sparse_fwd_triton(**a, config=prefill_config(64, 90))
        out_g, mx_g, lse_g = flash_mla_sparse_fwd_triton(**a)
        assert (out_g.float() - out_tl.float()).abs().max().item() <= 4 * max(err, 2**-8)
        _check_stat("lse", lse_g, lse_tl, "dispatch vs tl")
        _check_stat("max_logits", mx_g, mx_tl, "dispatch vs tl")
