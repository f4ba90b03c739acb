"""Gluon mma.sync sparse MLA decode over a bf16 paged cache (sm_80 / 86 / 89 / 120 / 121) against
``nsa_backend.reference``.

CPU: the support rules, the split plan (a function of the shapes only), the gate (never taken off CUDA) and the
launch (recorded, not run: every query row, head and split addressed where its output lies, the partials merged). The
ahead-of-time compile for sm_80 / 86 / 89 / 120 / 121 (within 99 KiB, registers and spills) is part of
``tests/ops/test_aot_resources.py`` (kind ``decode_bf16_mma_v2`` of the sparse_mla family).
GPU (a Triton with Gluon and an sm_80 or newer GPU; on an sm_90 GPU the kernel runs as the sm120 proxy runs it): a
300-case seeded fuzz of the kernel against the fp32 reference (1..128 heads and counts that are not multiples of
the head block, s_q 1..4, invalid slots, attn_sink, topk_length, spaced pages, pages of 32 and 64 slots, one and
several splits, two and three ring buffers), rows without a valid key, CUDA-graph capture, and the route of the
decode launcher under each arch it serves (forced).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from nsa_backend.kernels._arch import device_arch
from tests.ops._cuda_graph import capture
from tests.ops._gluon import gluon_available
from tests.ops._launch_recorder import LaunchRecorder
from tests.ops.test_sparse_mla import decode_case, run_decode_case
from tests.ops.test_sparse_mla_prefill_mma_v2 import check_decode_launch

triton = pytest.importorskip("triton")

FUZZ_CASES = min(300, int(os.environ.get("NSA_FUZZ_CASES", "300")))


def _on_gluon_gpu() -> bool:
    from nsa_backend.kernels._gluon import gluon_importable

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) and gluon_importable()


needs_gpu = pytest.mark.skipif(not _on_gluon_gpu(), reason="needs an sm_80+ GPU and Gluon")


def _case(**kw) -> dict:
    c = dict(B=3, s_q=2, h_q=64, topk=300, kv_format="bf16", scale_format="arbitrary", page=64, num_blocks=16,
             frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=9)
    return decode_case(**{**c, **kw})


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_support_rules():
    from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as G

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    for arch in (80, 86, 89, 120, 121):
        assert G.supported(q, cache, "bf16", 512, arch)
    for arch in (75, 90, 100, None):
        assert not G.supported(q, cache, "bf16", 512, arch)
    assert not G.supported(q, torch.zeros(4, 64, 656, dtype=torch.uint8), "fp8_ds_mla", 512, 120)
    assert not G.supported(q, cache.half(), "bf16", 512, 120)
    assert not G.supported(q[..., :512], cache[..., :512], "bf16", 448, 120)
    spaced = torch.zeros(4, 64 * 576 + 4, dtype=torch.bfloat16)[:, : 64 * 576].view(4, 64, 1, 576)
    assert not G.supported(q, spaced, "bf16", 512, 120)  # pages 8 bytes apart: not 16-byte aligned
    assert not G.supported(torch.zeros(1, 1, 0, 576, dtype=torch.bfloat16), cache, "bf16", 512, 120)


def test_plan_is_shape_only():
    from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as G

    splits, per = G.plan(32, 1, 64, 2048, 170)
    assert G.plan(32, 1, 64, 2048, 170) == (splits, per)
    # one wave of one program per SM: 32 rows x 2 head blocks x splits <= 170
    assert splits > 1 and 64 * splits <= 170 and splits * per >= 2048 and per % 32 == 0
    assert G.plan(128, 1, 128, 2048, 170)[0] == 1
    # 80 rows on 132 SMs: one split leaves 52 SMs idle; three make two waves of 22-tile programs (44 tiles against 64)
    assert G.plan(80, 1, 32, 2048, 132)[0] == 3
    # one user's decode: splits below 256 keys, down to 64-96 keys (splits-small-batches: 1.09-1.53x)
    assert G.plan(1, 1, 32, 2048, 132) == (22, 96)
    assert G.plan(4, 1, 128, 512, 132) == (8, 64)
    assert G.plan(1, 1, 64, 64, 170, num_splits=1) == (1, 64)


def test_gate_off_without_cuda():
    """Off CUDA (the interpreter) the decode op never takes the kernel, whatever arch is forced."""
    from nsa_backend.kernels.sparse_mla_decode import _mma_v2_bf16_route

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    assert not _mma_v2_bf16_route(q, cache, "bf16", 512, device_arch(q.device))


@pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_launch_addresses_every_row_head_and_split(monkeypatch, num_splits):
    """The decode launcher's arguments make the kernel read each query row's ``q`` and write each row's ``out`` /
    ``lse`` (one split) or each split's partials (several, then merged) where they are laid out, over the cache's
    spaced pages."""
    from nsa_backend.kernels.sparse_mla_decode import merge
    from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as G
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as tile

    rec = LaunchRecorder(tile.kernel())
    merged = []
    monkeypatch.setattr(G, "cached_launcher", lambda kernel: rec)
    monkeypatch.setattr(merge, "merge_splits", lambda *args: merged.append(args))
    B, s_q, h_q, topk, num_blocks, page = 3, 2, 40, 300, 5, 64
    q = torch.zeros(B, s_q, h_q, 576, dtype=torch.bfloat16)
    spaced = torch.zeros(num_blocks, page * 576 + 64, dtype=torch.bfloat16)  # pages 64 elements apart
    cache = spaced[:, : page * 576].view(num_blocks, page, 1, 576)
    idx = torch.zeros(B, s_q, topk, dtype=torch.int32)
    sink, topk_len = torch.zeros(h_q), torch.full((B,), topk, dtype=torch.int32)
    out, lse = G.sparse_mla_decode_bf16_mma_v2(q, cache, idx, 0.1, attn_sink=sink, topk_length=topk_len,
                                               num_splits=num_splits)
    ((grid, a, opt),) = rec.launches
    assert grid == (B * s_q * 2, num_splits)  # flat (row, head block) programs, one per split
    assert a["q_ptr"] is q and a["kv_ptr"] is cache and a["topk_len_ptr"] is topk_len and a["max_ptr"] is None
    assert (a["n_slots"], a["rows_per_batch"], a["topk"]) == (num_blocks * page, s_q, topk)
    assert (a["stride_page"], a["stride_row"]) == (cache.stride(0), cache.stride(1)) and opt["PAGE"] == page
    assert a["keys_per_split"] * num_splits >= topk and not opt["HAS_MAX"]
    check_decode_launch(a, opt, merged, q, out, lse, sink, num_splits, out_by_batch=False)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _fuzz_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        flags = rnd.random() < 0.5
        c = dict(
            B=rnd.randint(1, 4),
            s_q=rnd.randint(1, 4),
            h_q=rnd.choice((1, 16, 20, 32, 48, 64, 64, 128)),
            topk=rnd.choice([1, 31, 32, 33, 63, 64, 200, 512, 1024, 2048]),
            page=rnd.choice([64, 64, 32]),
            num_blocks=rnd.randint(1, 40),
            frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
            sink=flags,
            topk_len=flags or rnd.random() < 0.3,
            pad_pages=rnd.random() < 0.3,
            seed=7000 + i,
        )
        out.append((c, rnd.choice([{}, {}, {"num_splits": 1}, {"num_splits": 3}, {"stages": 3}])))
    return out


def _run(a: dict, case: str, **kw) -> float:
    from nsa_backend.kernels.sparse_mla_decode.sm80_gluon import sparse_mla_decode_bf16_mma_v2

    return run_decode_case(a, case, decode=sparse_mla_decode_bf16_mma_v2, **kw)


@pytest.mark.gpu
@needs_gpu
def test_decode_bf16_mma_v2_gpu_fuzz():
    errs = [_run(_case(**c), f"{c} {kw}", **kw) for c, kw in _fuzz_cases(FUZZ_CASES, seed=31)]
    print(f"bf16 mma_v2 decode fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@needs_gpu
def test_decode_bf16_mma_v2_empty_rows_gpu():
    from nsa_backend.kernels.sparse_mla_decode.sm80_gluon import sparse_mla_decode_bf16_mma_v2

    for kw in ({}, {"num_splits": 1}, {"num_splits": 2}):
        a = _case(B=2, topk=128, num_blocks=4, frac_invalid=0.0, topk_len=False, seed=3)
        a["indices"][0] = -1
        a["indices"][1, 1] = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]  # == n_slots: invalid
        _run(a, f"empty rows {kw}", **kw)
        out, lse = sparse_mla_decode_bf16_mma_v2(**a, **kw)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_decode_bf16_mma_v2_cuda_graph(h_q):
    from nsa_backend.kernels.sparse_mla_decode.sm80_gluon import sparse_mla_decode_bf16_mma_v2

    a = _case(B=8, s_q=1, h_q=h_q, topk=512, num_blocks=64, sink=False, seed=5)
    want = sparse_mla_decode_bf16_mma_v2(**a)
    g, got = capture(lambda: sparse_mla_decode_bf16_mma_v2(**a))
    got[0].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89", "sm120", "sm121", "sm100"])
def test_decode_op_routes_bf16_to_mma_v2(monkeypatch, arch):
    """With routing forced to an arch of ``MMA_V2_BF16_DECODE_ARCHS`` the decode launcher returns this kernel's
    result for the head counts it serves, and the ``tl`` kernel's otherwise (sm_100, ``NSA_BACKEND_GLUON=0``);
    both match the reference."""
    from nsa_backend.kernels import sparse_mla_decode as D
    from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as G
    from nsa_backend.routing.config import reset_config

    calls = []
    real = G.sparse_mla_decode_bf16_mma_v2
    monkeypatch.setattr(G, "sparse_mla_decode_bf16_mma_v2", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", arch)
    reset_config()
    try:
        for h_q, gluon in ((64, "1"), (128, "1"), (16, "1"), (64, "0")):
            monkeypatch.setenv("NSA_BACKEND_GLUON", gluon)
            before = len(calls)
            run_decode_case(_case(h_q=h_q), f"{arch} h_q {h_q} gluon {gluon}", decode=D.sparse_mla_decode_triton)
            routed = arch != "sm100" and gluon == "1" and h_q in D.MMA_V2_BF16_DECODE_HEADS
            assert len(calls) - before == routed, (arch, h_q, gluon)
    finally:
        monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH")
        monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)
        reset_config()
