"""Gluon mma.sync sparse MLA prefill (sm_80 / 86 / 89 / 120 / 121, bf16 keys) against ``nsa_backend.reference``.

CPU: the support rules, the gate (never taken off CUDA) and the launch (recorded, not run: the kernel reads
each row's ``q`` and writes each row's outputs where the op lays them out). The ahead-of-time compile for sm_80 /
86 / 89 / 120 / 121 (within 99 KiB, registers and spills) is part of ``tests/ops/test_aot_resources.py`` (kind
``prefill_mma_v2`` of the sparse_mla family).
GPU (a Triton with Gluon and an sm_80 or newer GPU; on an sm_90 GPU the kernel runs as the sm120 proxy runs it): a
300-case seeded fuzz of the kernel against the fp32 reference (1..128 heads and counts that are not multiples of
the head block, top-k lists of 1..4096 slots, invalid slots ``-1`` / ``>= s_kv`` / other negatives, attn_sink,
topk_length with empty rows, two and three ring buffers), rows without a valid key, scores that rise along the top-k
lists (the softmax's rescaling in later tiles), CUDA-graph capture, and the route of the prefill launcher under each
arch it serves (forced).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.ops._cuda_graph import capture
from tests.ops._gluon import gluon_available
from tests.ops._launch_recorder import LaunchRecorder, element_offsets
from tests.ops.test_sparse_mla import prefill_case, run_prefill_case

triton = pytest.importorskip("triton")

FUZZ_CASES = min(300, int(os.environ.get("NSA_FUZZ_CASES", "300")))


def _on_gluon_gpu() -> bool:
    from nsa_backend.kernels._gluon import gluon_importable

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) and gluon_importable()


needs_gpu = pytest.mark.skipif(not _on_gluon_gpu(), reason="needs an sm_80+ GPU and Gluon")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_support_rules(monkeypatch):
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as G

    monkeypatch.setattr("nsa_backend.kernels.sparse_mla_prefill.sm80_gluon.gluon_enabled",
                        lambda arch, archs: arch in archs)
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    for arch in (80, 86, 89, 120, 121):
        assert G.supported(q, kv, 512, arch)
    for arch in (75, 90, 100, None):
        assert not G.supported(q, kv, 512, arch)
    assert not G.supported(q.float(), kv, 512, 120)
    assert not G.supported(q, kv.to(torch.float16), 512, 120)
    assert not G.supported(torch.zeros(2, 64, 512, dtype=torch.bfloat16), kv[..., :512], 448, 120)
    assert not G.supported(q, torch.zeros(8, 1, 600, dtype=torch.bfloat16)[..., :576], 512, 120)  # rows not packed


def test_gate_off_without_cuda():
    """Off CUDA (the interpreter) the kernel is never taken, whatever arch is forced."""
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as G

    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not G.supported(q, torch.zeros(8, 1, 576, dtype=torch.bfloat16), 512, None)


def mma_v2_kernel_offsets(a: dict, rows: int, h_q: int, split: int = 0,
                          out_by_batch: bool = False) -> dict[str, torch.Tensor]:
    """Where the mma.sync kernels read ``q`` and write ``out`` / ``lse`` / ``max_logits`` for each ``(row, head)``
    of split ``split`` (element offsets from the pointers), computed from the launch's arguments ``a`` as the
    kernels compute them: a row is a flat query row, batch ``row // rows_per_batch``, position
    ``row % rows_per_batch``. ``out`` of ``_sparse_mla_mma_v2_kernel`` by ``row * stride_or`` (it never reads
    ``stride_ob``); of the fp8 decode's kernel by batch and position (``out_by_batch``)."""
    r = torch.arange(rows).view(-1, 1)
    h = torch.arange(h_q).view(1, -1)
    b, pos = r // a["rows_per_batch"], r % a["rows_per_batch"]
    out_row = b * a["stride_ob"] + pos * a["stride_or"] if out_by_batch else r * a["stride_or"]
    return {"q": r * a["stride_q_row"] + h * a["stride_q_head"],
            "out": out_row + split * a["stride_os"] + h * a["stride_oh"],
            "lse": b * a["stride_lb"] + pos * a["stride_lr"] + split * a["stride_ls"] + h * a["stride_lh"]}


def check_decode_launch(a: dict, opt: dict, merged: list, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        sink: torch.Tensor, num_splits: int, out_by_batch: bool) -> None:
    """Check a recorded decode launch of an mma.sync kernel (arguments ``a``, options ``opt``; ``merged``: the
    recorded ``merge_splits`` calls): every query row's ``q`` read and every row, head and split written where the
    op's tensors (``out [B, s_q, h_q, d_v]``, ``lse [B, h_q, s_q]``) or the split partials hold them."""
    B, s_q, h_q, _ = q.shape
    rows = B * s_q
    got = mma_v2_kernel_offsets(a, rows, h_q, out_by_batch=out_by_batch)
    assert torch.equal(got["q"], element_offsets(q).view(rows, h_q, -1)[..., 0])
    if num_splits == 1:
        assert a["out_ptr"] is out and a["lse_ptr"] is lse and a["sink_ptr"] is sink and opt["HAS_SINK"]
        assert not opt["SPLIT"] and not merged
        assert torch.equal(got["out"], element_offsets(out).view(rows, h_q, -1)[..., 0])
        assert torch.equal(got["lse"], element_offsets(lse).transpose(1, 2).reshape(rows, h_q))
        return
    part_o, part_lse = a["out_ptr"], a["lse_ptr"]
    assert opt["SPLIT"] and not opt["HAS_SINK"] and a["sink_ptr"] is None  # the merge applies the sink
    assert part_o.shape == (rows, num_splits, h_q, out.shape[-1]) and part_o.dtype == torch.float32
    ((m_o, m_lse, m_sink, m_out, m_final_lse),) = merged
    assert m_o is part_o and m_lse is part_lse and m_sink is sink and m_out is out and m_final_lse is lse
    for split in range(num_splits):
        got = mma_v2_kernel_offsets(a, rows, h_q, split, out_by_batch=out_by_batch)
        assert torch.equal(got["out"], element_offsets(part_o)[:, split, :, 0])
        assert torch.equal(got["lse"], element_offsets(part_lse)[:, split, :])


@pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon")
@pytest.mark.parametrize("stages", [2, 3])
def test_launch_addresses_every_row_and_head(monkeypatch, stages):
    """The prefill launcher's arguments make the kernel read each row's ``q`` and write each row's ``out``,
    ``lse`` and ``max_logits`` where the op lays them out (a stride passed as 0 put every row on row 0 once)."""
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as G

    rec = LaunchRecorder(G.kernel())
    monkeypatch.setattr(G, "cached_launcher", lambda kernel: rec)
    s_q, h_q, s_kv, topk = 5, 40, 70, 64
    q = torch.zeros(s_q, h_q, 576, dtype=torch.bfloat16)
    kv = torch.zeros(s_kv, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(s_q, 1, topk, dtype=torch.int32)
    sink = torch.zeros(h_q)
    out, max_logits, lse = G.flash_mla_sparse_fwd_mma_v2(q, kv, idx, 0.1, attn_sink=sink, stages=stages)
    ((grid, a, opt),) = rec.launches
    assert grid == (s_q * 2, 1)  # two 32-head blocks per row, one split
    assert a["q_ptr"] is q and a["out_ptr"] is out and a["lse_ptr"] is lse and a["max_ptr"] is max_logits
    assert a["sink_ptr"] is sink and a["topk_len_ptr"] is None
    assert (a["n_slots"], a["keys_per_split"], a["topk"], a["h_q"]) == (s_kv, topk, topk, h_q)  # 64: two tiles
    assert a["stride_page"] == 576 and a["idx_ptr"].shape == (s_q, topk) and a["stride_idx_row"] == topk
    assert (opt["PAGE"], opt["SPLIT"], opt["HAS_MAX"], opt["HAS_SINK"], opt["STAGES"]) == (1, False, True, True, stages)
    got = mma_v2_kernel_offsets(a, s_q, h_q)
    assert torch.equal(got["q"], element_offsets(q)[..., 0])
    assert torch.equal(got["out"], element_offsets(out)[..., 0])
    assert torch.equal(got["lse"], element_offsets(lse))
    assert torch.equal(got["lse"], element_offsets(max_logits))  # max_logits at lse's offsets


@pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon")
@pytest.mark.parametrize("topk,per", [(1, 32), (31, 32), (33, 64), (2048, 2048)])
def test_launch_passes_whole_tiles_per_split(monkeypatch, topk, per):
    """The prefill's one split is passed as whole 32-key tiles, never one key: Triton specialises an argument of 1
    into the kernel, and a one-key list then fixed the trip count of the two-tile loop, which Triton 3.6 could not
    lower. ``topk`` itself still bounds the keys."""
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as G

    rec = LaunchRecorder(G.kernel())
    monkeypatch.setattr(G, "cached_launcher", lambda kernel: rec)
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    G.flash_mla_sparse_fwd_mma_v2(q, torch.zeros(40, 1, 576, dtype=torch.bfloat16),
                                  torch.zeros(2, 1, topk, dtype=torch.int32), 0.1)
    ((_, a, _),) = rec.launches
    assert (a["keys_per_split"], a["topk"]) == (per, topk)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _fuzz_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        c = dict(
            s_q=rnd.randint(1, 6),
            h_q=rnd.choice((1, 7, 16, 20, 32, 48, 64, 64, 100, 128)),
            d_qk=576,
            s_kv=rnd.choice([1, 50, 777, 4096, 20000]),
            topk=rnd.choice([1, 7, 31, 32, 33, 64, 100, 333, 1024, 2048, 4096]),
            frac_invalid=rnd.choice([0.0, 0.05, 0.5, 0.95, 1.0]),
            sink=rnd.random() < 0.5,
            topk_len=rnd.random() < 0.5,
            seed=5000 + i,
        )
        out.append((c, rnd.choice([{}, {}, {}, {"stages": 3}])))
    return out


def _run(a: dict, case: str, **kw) -> float:
    from nsa_backend.kernels.sparse_mla_prefill.sm80_gluon import flash_mla_sparse_fwd_mma_v2

    return run_prefill_case(a, case, prefill=flash_mla_sparse_fwd_mma_v2, **kw)


@pytest.mark.gpu
@needs_gpu
def test_prefill_mma_v2_gpu_fuzz():
    errs = [_run(prefill_case(**c), f"{c} {kw}", **kw) for c, kw in _fuzz_cases(FUZZ_CASES, seed=29)]
    print(f"mma_v2 prefill fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@needs_gpu
def test_prefill_mma_v2_empty_rows_gpu():
    """Rows without a valid key (all ``-1``, all ``>= s_kv``, ``topk_length`` 0) between full ones: ``out`` 0,
    ``lse`` ``+inf``, ``max_logits`` ``-inf``, with a sink."""
    from nsa_backend.kernels.sparse_mla_prefill.sm80_gluon import flash_mla_sparse_fwd_mma_v2

    a = prefill_case(6, 64, 576, 3000, 192, 0.0, True, True, seed=7)
    a["indices"][0] = -1
    a["indices"][2] = 3000
    a["topk_length"][4] = 0
    _run(a, "empty rows")
    out, mx, lse = flash_mla_sparse_fwd_mma_v2(**a)
    for r in (0, 2, 4):
        assert torch.equal(out[r], torch.zeros_like(out[r])), r
        assert torch.isinf(lse[r]).all() and (lse[r] > 0).all(), r
        assert torch.isinf(mx[r]).all() and (mx[r] < 0).all(), r


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h_q", [20, 128])
def test_prefill_mma_v2_rising_scores_gpu(h_q):
    """Scores that keep rising along the top-k lists (key ``i`` scaled by ``1 + i / 64``; rows 0 and 2 list the keys
    in order, rows 1 and 3 in a random order): each row's running max grows in many later tiles, at other tiles in
    every row, so ``O`` is rescaled there, and ``out``, ``lse`` and ``max_logits`` still match the reference."""
    a = prefill_case(4, h_q, 576, 4096, 2048, 0.0, False, False, seed=11)
    dev = a["kv"].device
    a["kv"] = (a["kv"].float() * (1 + torch.arange(4096, device=dev) / 64)[:, None, None]).bfloat16()
    g = torch.Generator().manual_seed(3)
    for r in range(4):
        order = torch.arange(0, 4096, 2) if r % 2 == 0 else torch.randperm(4096, generator=g)[:2048]
        a["indices"][r, 0] = order.to(device=dev, dtype=torch.int32)
    _run(a, f"rising scores h_q {h_q}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_prefill_mma_v2_cuda_graph(h_q):
    from nsa_backend.kernels.sparse_mla_prefill.sm80_gluon import flash_mla_sparse_fwd_mma_v2

    a = prefill_case(8, h_q, 576, 4096, 512, 0.1, False, True, seed=5)
    want = flash_mla_sparse_fwd_mma_v2(**a)
    g, got = capture(lambda: flash_mla_sparse_fwd_mma_v2(**a))
    got[0].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89", "sm120", "sm121", "sm100"])
def test_prefill_op_routes_to_mma_v2(monkeypatch, arch):
    """With routing forced to an arch of ``MMA_V2_PREFILL_ARCHS`` the prefill launcher returns this kernel's
    result for the head counts it serves, and the ``tl`` kernel's otherwise (sm_100, ``NSA_BACKEND_GLUON=0``);
    both match the reference."""
    from nsa_backend.kernels import sparse_mla_prefill as P
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as G
    from nsa_backend.routing.config import reset_config

    calls = []
    real = G.flash_mla_sparse_fwd_mma_v2
    monkeypatch.setattr(G, "flash_mla_sparse_fwd_mma_v2", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", arch)
    reset_config()
    try:
        for h_q, gluon in ((64, "1"), (128, "1"), (16, "1"), (64, "0")):
            monkeypatch.setenv("NSA_BACKEND_GLUON", gluon)
            a = prefill_case(5, h_q, 576, 2000, 300, 0.1, True, True, seed=9)
            before = len(calls)
            run_prefill_case(a, f"{arch} h_q {h_q} gluon {gluon}")
            routed = arch != "sm100" and gluon == "1" and h_q in P.MMA_V2_PREFILL_HEADS
            assert len(calls) - before == routed, (arch, h_q, gluon)
    finally:
        monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH")
        monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)
        reset_config()
