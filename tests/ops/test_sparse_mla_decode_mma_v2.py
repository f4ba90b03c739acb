"""Gluon mma.sync sparse MLA decode (sm_80 / 86 / 89 / 120 / 121, "fp8_ds_mla" cache) against ``nsa_backend.reference``.

CPU: the support rules, the split plan (a function of the shapes only), the gate (never taken off CUDA) and the
launch (recorded, not run: every query row, head and split addressed where its output lies, the partials merged).
The integer e4m3 decoding of sm_80 / 86 (``e4m3_f16_dequant_ptx``: its selectors, shift and mask on every byte, the
scale's product and the bf16 rounding, against the reference's dequantisation). The ahead-of-time compile for
sm_86 / 120 / 121 (within 99 KiB, registers and spills) is part of
``tests/ops/test_aot_resources.py`` (kind ``decode_mma_v2`` of the sparse_mla family).
GPU (a Triton with Gluon and a GPU with e4m3, sm_89 or newer; on an sm_90 GPU the kernel runs as the sm120
proxy runs it): a 300-case seeded fuzz of the kernel against the fp32 reference, with the fp8 conversions and with
the integer decoding of sm_80 / 86 (forced arch), which gives bitwise the same outputs (1..128 heads and counts that
are not multiples of the head block, s_q 1..4, invalid slots, both scale formats and the power-of-two
conversion, attn_sink, topk_length, spaced pages, pages of 32 and 64 slots, one and several splits, two and
three ring buffers), rows without a valid key, scores that rise by just under and just over the softmax's rescale
threshold from one tile to the next, CUDA-graph capture, and the route of the decode launcher under each arch it
serves (forced).
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from nsa_backend import reference as ref
from nsa_backend.kernels._arch import device_arch
from tests.ops._cuda_graph import capture
from tests.ops._gluon import gluon_available
from tests.ops._launch_recorder import LaunchRecorder
from tests.ops._ptx_steps import byte_pairs, prmt_shift_mask
from tests.ops.test_sparse_mla import _check_out, _check_stat, _fp32_reference_decode, decode_case, run_decode_case
from tests.ops.test_sparse_mla_prefill_mma_v2 import check_decode_launch

triton = pytest.importorskip("triton")

FUZZ_CASES = min(300, int(os.environ.get("NSA_FUZZ_CASES", "300")))


def _on_gluon_fp8_gpu() -> bool:
    from nsa_backend.kernels._gluon import gluon_importable

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and gluon_importable()


needs_gpu = pytest.mark.skipif(not _on_gluon_fp8_gpu(), reason="needs a GPU with e4m3 (sm_89+) and Gluon")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_support_rules():
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    for arch in (80, 86, 89, 120, 121):
        assert G.supported(q, cache, "fp8_ds_mla", 512, arch)
    for arch in (75, 90, 100, None):
        assert not G.supported(q, cache, "fp8_ds_mla", 512, arch)
    assert not G.supported(q, torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16), "bf16", 512, 120)
    assert not G.supported(torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16), cache, "fp8_ds_mla", 448, 120)
    spaced = torch.zeros(4, 65 * 656 + 8, dtype=torch.uint8)[:, : 64 * 656].view(4, 64, 656)
    assert not G.supported(q, spaced, "fp8_ds_mla", 512, 120)
    rows = torch.zeros(G.MAX_ROWS + 1, 1, 1, 576, dtype=torch.bfloat16).expand(G.MAX_ROWS + 1, 1, 64, 576)
    assert not G.supported(rows, cache, "fp8_ds_mla", 512, 120)
    assert G.supported(rows[: G.MAX_ROWS], cache, "fp8_ds_mla", 512, 120)


def test_plan_is_shape_only():
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G

    assert G.plan(32, 1, 64, 2048, 170) == G.plan(32, 1, 64, 2048, 170)
    splits, per = G.plan(32, 1, 64, 2048, 170)
    # one wave of one program per SM: 32 rows x 2 head blocks x splits <= 170
    assert splits > 1 and 64 * splits <= 170 and splits * per >= 2048 and per % G.BLOCK_N == 0
    assert G.plan(128, 1, 128, 2048, 170)[0] == 1
    # 80 rows on 132 SMs: one split leaves 52 SMs idle; three make two waves of 22-tile programs (44 tiles against 64)
    assert G.plan(80, 1, 32, 2048, 132)[0] == 3
    # one user's decode: splits below 256 keys, down to 64-96 keys (splits-small-batches: 1.09-1.53x)
    assert G.plan(1, 1, 32, 2048, 132) == (22, 96)
    assert G.plan(4, 1, 128, 512, 132) == (8, 64)
    assert G.plan(1, 1, 64, 64, 170, num_splits=1) == (1, 64)


def test_gate_off_without_cuda():
    """Off CUDA (the interpreter) the decode op never takes the kernel, whatever arch is forced."""
    from nsa_backend.kernels.sparse_mla_decode import _mma_v2_route

    q = torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16)
    assert not _mma_v2_route(q, torch.zeros(4, 64, 656, dtype=torch.uint8), "fp8_ds_mla", 512, device_arch(q.device))


def test_integer_dequant_is_the_reference_dequant():
    """The steps of ``e4m3_f16_dequant_ptx`` (sm_80 / 86), read from its source, give for every pair of bytes the fp16
    bits of ``e4m3(b) * 2^-8`` exactly (subnormals and signed zeros included); with the fp32 product by
    ``scale * 2^8`` and the bf16 rounding that is the reference's ``bf16(e4m3 * scale)`` for any scale."""
    from nsa_backend.kernels.sparse_mla_prefill.common import e4m3_f16_dequant_ptx
    from nsa_backend.reference import unpack_fp8_ds_mla

    src = e4m3_f16_dequant_ptx()
    sel = [int(x, 16) for x in re.findall(r"prmt\.b32 \w, \$2, 0, (0x[0-9A-Fa-f]+);", src)]
    (shift,) = {int(x) for x in re.findall(r"shl\.b32 \w, \w, (\d+);", src)}
    (mask,) = {int(x, 16) for x in re.findall(r"and\.b32 \w, \w, (0x[0-9A-Fa-f]+);", src)}
    assert len(sel) == 2 and "cvt.rn.bf16x2.f32 $0, f1, f0;" in src and "mul.rn.f32 f3, f3, $6;" in src, src
    words = byte_pairs()
    e4m3 = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(e4m3)
    gen = torch.Generator().manual_seed(0)
    scales = torch.cat([torch.rand(6, generator=gen) * 3, torch.tensor([1.0, 2.0**-12, 2.0**7, 0.0917])])
    for selector, cols in zip(sel, ((0, 1), (2, 3))):
        halves = prmt_shift_mask(words, selector, shift, mask)
        got = halves.to(torch.int16).view(torch.float16).float()
        want = e4m3[words[:, list(cols)].long()]
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok] * 256.0, want[ok])
        assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))
    # every byte with each scale, through the product and the rounding, against the reference's dequantisation
    codes = torch.arange(256).to(torch.uint8)
    values = prmt_shift_mask(torch.stack([codes, codes, codes, codes], 1), sel[0], shift, mask)[:, 0]
    values = values.to(torch.int16).view(torch.float16).float()
    for scale in scales.tolist():
        got = (values * torch.tensor(scale * 256.0)).to(torch.bfloat16)
        row = torch.zeros(1, 656, dtype=torch.uint8)
        row[0, 512:528] = torch.tensor([scale] * 4, dtype=torch.float32).view(torch.uint8)
        for start in range(0, 256, 128):
            row[0, :128] = codes[start:start + 128]
            want = unpack_fp8_ds_mla(row)[0, :128]
            assert torch.equal(got[start:start + 128][finite[start:start + 128]],
                               want[finite[start:start + 128]]), scale


@pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon")
def test_launch_decodes_e4m3_by_the_routed_arch(monkeypatch):
    """``FP8_NATIVE`` follows the arch the launch is routed for: the fp8 conversions from sm_89 on, the integer
    decoding on sm_80 / 86."""
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G

    rec = LaunchRecorder(G.kernel())
    monkeypatch.setattr(G, "cached_launcher", lambda kernel: rec)
    q = torch.zeros(1, 1, 32, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 64, dtype=torch.int32)
    for arch, native in ((80, False), (86, False), (89, True), (120, True), (121, True)):
        monkeypatch.setattr(G, "device_arch", lambda device, arch=arch: arch)
        G.sparse_mla_decode_mma_v2(q, cache, idx, 0.1, num_splits=1)
        assert rec.launches[-1][2]["FP8_NATIVE"] is native, arch


@pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_launch_addresses_every_row_head_and_split(monkeypatch, num_splits):
    """The launcher's arguments make the kernel read each query row's ``q`` and write each row's ``out`` / ``lse``
    (one split) or each split's partials (several, then merged) where they are laid out."""
    from nsa_backend.kernels.sparse_mla_decode import merge
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G

    rec = LaunchRecorder(G.kernel())
    merged = []
    monkeypatch.setattr(G, "cached_launcher", lambda kernel: rec)
    monkeypatch.setattr(merge, "merge_splits", lambda *args: merged.append(args))
    B, s_q, h_q, topk, num_blocks, page = 3, 2, 40, 300, 5, 64
    q = torch.zeros(B, s_q, h_q, 576, dtype=torch.bfloat16)
    cache = torch.zeros(num_blocks, page, 656, dtype=torch.uint8)
    idx = torch.zeros(B, s_q, topk, dtype=torch.int32)
    sink = torch.zeros(h_q)
    out, lse = G.sparse_mla_decode_mma_v2(q, cache, idx, 0.1, attn_sink=sink, num_splits=num_splits)
    ((grid, a, opt),) = rec.launches
    assert grid == (2, B * s_q, num_splits)  # (head blocks, query rows, splits)
    assert (a["n_slots"], a["rows_per_batch"], a["stride_page"], a["stride_row"]) == (num_blocks * page, s_q,
                                                                                       page * 656, 656)
    assert a["keys_per_split"] * num_splits >= topk and opt["PAGE"] == page and opt["SPLIT"] == (num_splits > 1)
    check_decode_launch(a, opt, merged, q, out, lse, sink, num_splits, out_by_batch=True)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _fuzz_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        flags = rnd.random() < 0.5
        scale_format = rnd.choice(["pow2", "arbitrary"])
        c = dict(
            B=rnd.randint(1, 4),
            s_q=rnd.randint(1, 4),
            h_q=rnd.choice((1, 16, 20, 32, 48, 64, 64, 128)),
            topk=rnd.choice([1, 31, 32, 33, 63, 64, 200, 512, 1024, 2048]),
            kv_format="fp8_ds_mla",
            scale_format=scale_format,
            page=rnd.choice([64, 64, 32]),
            num_blocks=rnd.randint(1, 40),
            frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
            sink=flags,
            topk_len=flags or rnd.random() < 0.3,
            pad_pages=rnd.random() < 0.3,  # pages of 656-byte rows stay 16-byte aligned
            seed=3000 + i,
        )
        kw = rnd.choice([{}, {}, {"num_splits": 1}, {"num_splits": 3}, {"stages": 3}])
        if scale_format == "pow2" and rnd.random() < 0.5:
            kw = {**kw, "kv_scale_format": "pow2"}
        out.append((c, kw))
    return out


def _run(a: dict, case: str, **kw) -> float:
    from nsa_backend.kernels.sparse_mla_decode.sm89_gluon import sparse_mla_decode_mma_v2

    return run_decode_case(a, case, decode=sparse_mla_decode_mma_v2, **kw)


@pytest.fixture
def routed_arch(monkeypatch, request):
    """Routing forced to ``request.param`` (``None``: the GPU's own arch) for the test's duration."""
    from nsa_backend.routing.config import reset_config

    if request.param is not None:
        monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", request.param)
    reset_config()
    yield request.param
    monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH", raising=False)
    reset_config()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("routed_arch", [None, "sm86"], indirect=True)
def test_decode_mma_v2_gpu_fuzz(routed_arch):
    """The fuzz with the GPU's fp8 conversions, and with sm_86's integer decoding."""
    errs = [_run(decode_case(**c), str(c) + str(kw), **kw) for c, kw in _fuzz_cases(FUZZ_CASES, seed=23)]
    print(f"mma_v2 decode fuzz ({routed_arch or 'native'}): {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@needs_gpu
def test_decode_mma_v2_integer_decoding_is_bitwise_the_fp8_units(monkeypatch):
    """sm_80 / 86's integer decoding gives the keys the fp8 conversions give, so the outputs are bitwise equal (every
    byte value but the NaN codes occurs in the random caches, with arbitrary and power-of-two scales)."""
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G

    for scale_format, kw in (("arbitrary", {}), ("arbitrary", {"num_splits": 3}), ("pow2", {})):
        c = dict(B=4, s_q=2, h_q=64, topk=512, kv_format="fp8_ds_mla", scale_format=scale_format, page=64,
                 num_blocks=32, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=11)
        a = decode_case(**c)
        raw = a["kv_cache"].view(-1, 656)[:, :512]
        assert torch.unique(raw).numel() == 254, torch.unique(raw).numel()  # all but 0x7f and 0xff
        results = []
        for arch in (120, 86):
            monkeypatch.setattr(G, "device_arch", lambda device, arch=arch: arch)
            results.append(G.sparse_mla_decode_mma_v2(**a, **kw))
        (o_n, l_n), (o_i, l_i) = results
        assert torch.equal(o_n, o_i) and torch.equal(l_n, l_i), (scale_format, kw)


@pytest.mark.gpu
@needs_gpu
def test_decode_mma_v2_empty_rows_gpu():
    from nsa_backend.kernels.sparse_mla_decode.sm89_gluon import sparse_mla_decode_mma_v2

    c = dict(B=2, s_q=2, h_q=64, topk=128, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
             num_blocks=4, frac_invalid=0.0, sink=True, topk_len=False, pad_pages=False, seed=3)
    for kw in ({}, {"num_splits": 1}, {"num_splits": 2}):
        a = decode_case(**c)
        a["indices"][0] = -1
        a["indices"][1, 1] = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]  # == n_slots: invalid
        _run(a, f"empty rows {kw}", **kw)
        out, lse = sparse_mla_decode_mma_v2(**a, **kw)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


# Per 32-key tile, the largest score (base 2, for a head of scale 1): the reference of the softmax's exponentials moves
# in tile 0, stays at 0 through 7.5 (P up to 2^7.5), moves to 8.5, stays through 16.0 (7.5 above it), moves to 30.
THRESHOLD_TILE_MAX = (0.0, 7.5, 8.5, 16.0, 30.0)


def threshold_case(h_q: int, scale_format: str, block_n: int, device: str = "cuda") -> dict:
    """Three query rows over keys whose scores rise by just under and just over the rescale threshold (8, base 2)
    from one tile to the next (``THRESHOLD_TILE_MAX``). The scores come from the first rope dimension only (stored
    as bf16 in the cache): the key's is its base-2 score, each head's its scale, 0.5 to 1.25, so that the heads of
    one warp differ. Row 0 lists the keys in that order, row 1 in reverse (the max in the first tile), row 2 at
    random."""
    n = len(THRESHOLD_TILE_MAX) * block_n
    g = torch.Generator().manual_seed(5)
    tile_max = torch.tensor(THRESHOLD_TILE_MAX).repeat_interleave(block_n)
    score2 = tile_max - torch.rand(n, generator=g) * 6.0
    score2[::block_n] = tile_max[::block_n]
    sm_scale = 576**-0.5
    kv = torch.randn(n, 576, generator=g)
    kv[:, 512:] = 0.0
    kv[:, 512] = score2 / (sm_scale * 1.4426950408889634)
    page = 32
    rows = ref.pack_fp8_ds_mla(kv.bfloat16(), scale_format).view(n // page, page, 656)
    q = torch.zeros(3, 1, h_q, 576)
    q[..., 512] = 0.5 + 0.75 * torch.arange(h_q) / max(h_q - 1, 1)
    order = torch.arange(n)
    idx = torch.stack([order, order.flip(0), torch.randperm(n, generator=g)]).view(3, 1, n).to(torch.int32)
    args = dict(q=q.bfloat16(), kv_cache=rows, indices=idx, sm_scale=sm_scale, d_v=512, kv_format="fp8_ds_mla",
                attn_sink=None, topk_length=None)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h_q", [32, 128])
def test_decode_mma_v2_rescale_threshold_gpu(h_q):
    """The reference of the exponentials (``LAZY_RESCALE`` of ``mma_v2_attend_tile``) kept and moved as the scores
    rise by just under and just over the threshold (``threshold_case``): ``out`` and ``lse`` match the reference,
    in one split and in two, with both scale formats."""
    from nsa_backend.kernels.sparse_mla_decode.sm89_gluon import BLOCK_N

    for scale_format, kw in (("arbitrary", {"num_splits": 1}), ("arbitrary", {"num_splits": 2}),
                             ("pow2", {"num_splits": 1, "kv_scale_format": "pow2"})):
        _run(threshold_case(h_q, scale_format, BLOCK_N), f"threshold h_q {h_q} {scale_format} {kw}", **kw)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_decode_mma_v2_cuda_graph(h_q):
    from nsa_backend.kernels.sparse_mla_decode.sm89_gluon import sparse_mla_decode_mma_v2

    c = dict(B=8, s_q=1, h_q=h_q, topk=512, kv_format="fp8_ds_mla", scale_format="arbitrary", page=64,
             num_blocks=64, frac_invalid=0.1, sink=False, topk_len=True, pad_pages=False, seed=5)
    a = decode_case(**c)
    want = sparse_mla_decode_mma_v2(**a)
    g, got = capture(lambda: sparse_mla_decode_mma_v2(**a))
    got[0].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["sm89", "sm120", "sm121", "sm86", "sm80", "sm100"])
def test_decode_op_routes_to_mma_v2(monkeypatch, arch):
    """With routing forced to an arch of ``MMA_V2_DECODE_ARCHS`` the decode launcher returns this kernel's result
    for the head counts it serves, and the ``tl`` kernel's otherwise (sm_100, ``NSA_BACKEND_GLUON=0``); both match
    the reference."""
    from nsa_backend.kernels import sparse_mla_decode as D
    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as G
    from nsa_backend.routing.config import reset_config

    calls = []
    real = G.sparse_mla_decode_mma_v2
    monkeypatch.setattr(G, "sparse_mla_decode_mma_v2", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", arch)
    reset_config()
    try:
        for h_q, gluon in ((64, "1"), (128, "1"), (64, "0")):
            monkeypatch.setenv("NSA_BACKEND_GLUON", gluon)
            c = dict(B=3, s_q=2, h_q=h_q, topk=300, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
                     num_blocks=16, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=9)
            a = decode_case(**c)
            before = len(calls)
            out, lse = D.sparse_mla_decode_triton(**a)
            routed = arch != "sm100" and gluon == "1" and h_q in D.MMA_V2_DECODE_HEADS
            assert len(calls) - before == routed, (arch, h_q, gluon)
            r_out, r_lse, r_abs = _fp32_reference_decode(a)
            _check_out("out", out.view(r_out.shape), r_out, f"{arch} h_q {h_q}", r_abs)
            _check_stat("lse", lse, r_lse, f"{arch} h_q {h_q}")
    finally:
        monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH")
        monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)
        reset_config()
