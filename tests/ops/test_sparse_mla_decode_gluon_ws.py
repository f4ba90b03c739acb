"""Warp-specialised 64-head Gluon sparse MLA decode (sm_90, "fp8_ds_mla") against ``nsa_backend.reference``.

CPU: the kernel compiled ahead of time for sm_90 in a subprocess (skipped where the installed Triton
has no Gluon), split and final variants, within the shared-memory limit; the split plan is a function
of the shapes only; the support rules; the route of ``sparse_mla_decode_triton`` (never off CUDA,
never below ``GLUON_WS_DECODE_MIN_HEADS`` heads, never when the module is not ``ENABLED``).
GPU (sm_90): a seeded fuzz against the fp32 reference (h_q 17..128 including counts that are not
multiples of 64, s_q 1..4, invalid slots, both scale formats, attn_sink, topk_length, spaced pages,
both cache ranks, one and several splits), rows without a valid key, CUDA-graph capture, and the
route of ``sparse_mla_decode_triton`` when the kernel is enabled.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

from nsa_backend.kernels._arch import device_arch
from tests.ops._aot import run_aot_script
from tests.ops._cuda_graph import capture
from tests.ops._gluon import gluon_available, on_sm90_gluon
from tests.ops.test_sparse_mla import (
    _check_out,
    _check_stat,
    _fp32_reference_decode,
    decode_case,
    run_decode_case,
)

triton = pytest.importorskip("triton")



# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------

_AOT = textwrap.dedent(
    """
    import json
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as m
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    rows = []
    for split in (False, True):
        k = m.compile_for_sm90(split)
        rows.append(["gluon_ws_decode", 90, split, k.metadata.shared, SHARED_MEMORY_LIMIT[90]])
    # the kernel without the loader's share of the dequantisation
    k = m.compile_for_sm90(False, LOADER_DQ=0, LOADER_REGS=56)
    rows.append(["gluon_ws_decode", 90, "LOADER_DQ=0", k.metadata.shared, SHARED_MEMORY_LIMIT[90]])
    print(json.dumps(rows))
    """
)

_AOT_POW2 = textwrap.dedent(
    """
    import json
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as m
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    out = {}
    for pow2 in (False, True):
        k = m.compile_for_sm90(True, POW2_SCALES=pow2)
        ptx = k.asm["ptx"]
        out[str(pow2)] = {"e4m3_cvt": ptx.count("e4m3x2"), "bf16x2_mul": ptx.count("mul.rn.bf16x2"),
                          "shared": k.metadata.shared, "limit": SHARED_MEMORY_LIMIT[90]}
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not gluon_available(), reason="this Triton has no Gluon")
def test_ws_decode_compiles_for_sm90_within_shared_memory():
    rows = run_aot_script(_AOT, timeout=240)
    assert len(rows) == 3
    for kind, arch, split, shared, limit in rows:
        assert 0 < shared <= limit, f"{kind} sm_{arch} split={split}: {shared} B shared > {limit} B"


@pytest.mark.skipif(not gluon_available(), reason="this Triton has no Gluon")
def test_ws_decode_pow2_conversion_takes_the_integer_path():
    """With ``POW2_SCALES`` the kernel converts the keys (compute and loader partitions) without the fp8 unit:
    integer bits times a bf16 scale; without it, with the fp8 conversions only."""
    counts = run_aot_script(_AOT_POW2, timeout=240)
    exact, pow2 = counts["False"], counts["True"]
    assert exact["e4m3_cvt"] > 0 and exact["bf16x2_mul"] == 0, exact
    assert pow2["e4m3_cvt"] == 0 and pow2["bf16x2_mul"] > 0, pow2
    assert pow2["shared"] <= pow2["limit"], pow2


def test_ws_decode_plan_is_shape_only():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import BLOCK_N, plan

    assert plan(32, 1, 64, 2048, 132) == plan(32, 1, 64, 2048, 132)
    splits, per = plan(32, 1, 64, 2048, 132)
    assert splits > 1 and splits * per >= 2048 and per % BLOCK_N == 0
    assert plan(128, 1, 64, 2048, 132)[0] == 1
    assert plan(128, 2, 128, 2048, 132)[0] == 1
    assert plan(1, 1, 64, 64, 132) == (1, 64)
    # where the one-wave plan leaves SMs idle (wave_filling_splits; splits-small-batches/sm90-native: 1.17x, 1.11x)
    assert plan(1, 1, 64, 2048, 132) == (16, 128)
    assert plan(80, 1, 64, 2048, 132)[0] == 3
    assert plan(4, 1, 128, 2048, 132, num_splits=3) == (3, 704)


def test_ws_decode_support_rules():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import supported

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    assert supported(q, cache, "fp8_ds_mla", 512, 90)
    assert supported(q, cache.view(4, 64, 1, 656), "fp8_ds_mla", 512, 90)
    assert not supported(q, cache, "fp8_ds_mla", 512, 120)
    assert not supported(q, cache, "fp8_ds_mla", 512, None)
    assert not supported(q, torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16), "bf16", 512, 90)
    assert not supported(torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16), cache, "fp8_ds_mla", 512, 90)
    spaced = torch.zeros(4, 65 * 656 + 8, dtype=torch.uint8)[:, : 64 * 656].view(4, 64, 656)
    assert not supported(q, spaced, "fp8_ds_mla", 512, 90)
    many = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16).expand(70000, 1, 64, 576)
    assert not supported(many, cache, "fp8_ds_mla", 512, 90)


def test_ws_route_off_cuda_and_by_heads(monkeypatch):
    """Off CUDA (the interpreter) the decode op never takes the kernel, nor below the head threshold,
    nor when the module is not enabled."""
    from nsa_backend.kernels import sparse_mla_decode as D
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as ws

    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    monkeypatch.setattr(ws, "ENABLED", True)
    q64 = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    assert not D._gluon_ws_route(q64, cache, "fp8_ds_mla", 512, device_arch(q64.device))
    q16 = torch.zeros(1, 1, D.GLUON_WS_DECODE_MIN_HEADS - 1, 576, dtype=torch.bfloat16)
    assert not D._gluon_ws_route(q16, cache, "fp8_ds_mla", 512, 90)
    assert not set(D.GLUON_DECODE_HEADS) & set(range(D.GLUON_WS_DECODE_MIN_HEADS, 129))


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)
# ------------------------------------------------------------------------------------------------

HEADS = (64, 64, 128, 128, 17, 32, 96, 100)


def _ws_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        flags = rnd.random() < 0.5
        c = dict(
            B=rnd.randint(1, 4),
            s_q=rnd.randint(1, 4),
            h_q=rnd.choice(HEADS),
            topk=rnd.choice([1, 63, 64, 200, 512, 1000, 2048]),
            kv_format="fp8_ds_mla",
            scale_format=rnd.choice(["pow2", "arbitrary"]),
            page=rnd.choice([64, 64, 32]),
            num_blocks=rnd.randint(1, 40),
            frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95, 1.0]),
            sink=flags,
            topk_len=flags or rnd.random() < 0.3,
            pad_pages=rnd.random() < 0.3,  # pages of 656-byte rows stay 16-byte aligned
            seed=2000 + i,
        )
        kw = rnd.choice([{}, {}, {"num_splits": 1}, {"num_splits": 3}, {"options": {"DQ_VEC": 16}},
                         {"options": {"LOADER_DQ": 0, "LOADER_REGS": 56}},
                         {"options": {"LOADER_DQ": 1, "LOADER_REGS": 72}}])
        out.append((c, kw))
    return out


def _run_ws(a: dict, case: str, **kw) -> float:
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import sparse_mla_decode_gluon_ws

    return run_decode_case(a, case, decode=sparse_mla_decode_gluon_ws, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_ws_decode_gpu_fuzz():
    errs = []
    for i, (c, kw) in enumerate(_ws_cases(120, seed=11)):
        a = decode_case(**c)
        if i % 2:  # the [num_blocks, page, 1, 656] cache rank
            a["kv_cache"] = a["kv_cache"].unsqueeze(2)
        errs.append(_run_ws(a, str(c) + str(kw), **kw))
    print(f"ws decode fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_ws_decode_pow2_scales_same_numbers_gpu():
    """``kv_scale_format="pow2"`` on caches written with power-of-two scales: bit-identical to the exact
    conversion (the same keys) over seeded cases, and within tolerance through the public op."""
    import nsa_backend as nb
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import sparse_mla_decode_gluon_ws

    for c, kw in _ws_cases(24, seed=23):
        if "options" in kw:  # the kernel constants as shipped (each variant is a compile)
            continue
        a = decode_case(**{**c, "scale_format": "pow2"})
        case = str(c) + str(kw)
        want_o, want_l = sparse_mla_decode_gluon_ws(**a, **kw)
        got_o, got_l = sparse_mla_decode_gluon_ws(**a, **kw, kv_scale_format="pow2")
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), case
    # the public op: 32 and 64 heads take this kernel
    for h_q, seed in ((32, 41), (64, 43), (128, 47)):
        c = dict(B=4, s_q=2, h_q=h_q, topk=512, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
                 num_blocks=32, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=seed)
        run_decode_case(decode_case(**c), str(c), decode=lambda **x: nb.sparse_mla_decode(
            **x, kv_scale_format="pow2", impl="triton"))


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_ws_decode_empty_rows_gpu():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import sparse_mla_decode_gluon_ws

    c = dict(B=2, s_q=2, h_q=64, topk=256, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
             num_blocks=4, frac_invalid=0.0, sink=True, topk_len=False, pad_pages=False, seed=3)
    for kw in ({}, {"num_splits": 1}, {"num_splits": 2}):
        a = decode_case(**c)
        a["indices"][0] = -1
        a["indices"][1, 1] = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]  # == n_slots: invalid
        _run_ws(a, f"empty rows {kw}", **kw)
        out, lse = sparse_mla_decode_gluon_ws(**a, **kw)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_ws_decode_cuda_graph():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import sparse_mla_decode_gluon_ws

    c = dict(B=8, s_q=2, h_q=128, topk=512, kv_format="fp8_ds_mla", scale_format="arbitrary", page=64,
             num_blocks=64, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=5)
    a = decode_case(**c)
    want = sparse_mla_decode_gluon_ws(**a)
    g, got = capture(lambda: sparse_mla_decode_gluon_ws(**a))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_decode_op_routes_many_heads_to_ws(monkeypatch):
    """With the kernel enabled, ``sparse_mla_decode_triton`` takes it for 64 heads, the tl kernel with
    ``NSA_BACKEND_GLUON=0`` (both match the reference)."""
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as ws
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

    c = dict(B=3, s_q=2, h_q=64, topk=300, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
             num_blocks=16, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=9)
    a = decode_case(**c)
    monkeypatch.setattr(ws, "ENABLED", True)
    monkeypatch.setenv("NSA_BACKEND_GLUON", "1")
    got = sparse_mla_decode_triton(**a)
    want = ws.sparse_mla_decode_gluon_ws(**a)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    tl_out = sparse_mla_decode_triton(**a)
    r_out, r_lse, r_abs = _fp32_reference_decode(a)
    for out, lse in (got, tl_out):
        _check_out("out", out.view(r_out.shape), r_out, "route", r_abs)
        _check_stat("lse", lse, r_lse, "route")
