"""Gluon sparse MLA decode (sm_90, "fp8_ds_mla" cache) against ``nsa_backend.reference``.

CPU: the kernel compiled ahead of time for sm_90 in a subprocess (skipped where the installed Triton
has no Gluon), for every plan the launcher can pick, within the shared-memory limit and without
register spills; the split plan is a function of the shapes only; the ``tl``
route is kept where the Gluon kernel does not apply.
GPU (sm_90): a seeded fuzz against the reference (16 / 32 / 64 / 128 heads and counts that are not
multiples of the head block, s_q 1..4, invalid slots, both scale formats, attn_sink, topk_length,
spaced pages, pages of 32 and 64 slots, one and several splits), the same for the pair kernel
(16-head blocks, odd / even / single tile counts), rows without a valid key and CUDA-graph capture
for both kernels, and the route of ``sparse_mla_decode_triton`` to the Gluon kernel.
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
from tests.ops._ptx_steps import byte_pairs, prmt_shift_mask
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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon as m
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    fn = m._sparse_mla_decode_gluon_kernel
    ptrs = ["q_ptr", "kv_ptr", "idx_ptr", "sink_ptr", "topk_len_ptr", "out_ptr", "lse_ptr"]
    ints = ["h_q", "topk", "n_slots", "keys_per_split", "rows_per_batch", "stride_q_row",
            "stride_q_head", "stride_idx_row", "stride_page", "stride_row", "stride_ob", "stride_or",
            "stride_os", "stride_oh", "stride_lb", "stride_lr", "stride_ls", "stride_lh"]
    aligned = set(ptrs) | {"stride_q_row", "stride_q_head", "stride_idx_row", "stride_page", "stride_row"}
    rows = []
    plans = {m._plan_default(h) for h in (16, 32, 64, 128)}
    for bh, bn, st in sorted(plans):
        for split in (True, False):
            sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32",
                   "topk_len_ptr": "*i32", "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32",
                   "qk_scale": "fp32"}
            sig.update({n: "i32" for n in ints})
            ce = dict(PAGE=64, BLOCK_H=bh, BLOCK_N=bn, STAGES=st, SPLIT=split, HAS_SINK=not split,
                      HAS_TOPK_LEN=True, NUM_WARPS=m.GLUON_DECODE_NUM_WARPS, LOADER_WARPS=m.LOADER_WARPS,
                      LOADER_REGS=m.LOADER_REGS)
            sig.update({k: "constexpr" for k in ce})
            assert set(sig) == set(fn.arg_names), set(sig) ^ set(fn.arg_names)
            names = list(fn.arg_names)
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            src = GluonASTSource(fn, signature={n: sig[n] for n in names}, constexprs=ce, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": m.GLUON_DECODE_NUM_WARPS})
            # register spills show up as local-memory stores in the SASS
            try:
                spills = k.asm["sass"].count("STL ")
            except Exception:  # no disassembler: shared memory only
                spills = 0
            rows.append(["gluon_decode", 90, [bh, bn, st, split], k.metadata.shared, SHARED_MEMORY_LIMIT[90],
                         spills])
    # the pair kernel (16-head blocks), with both conversions of the keys
    fn = m._sparse_mla_decode_gluon_pair_kernel
    for split, pow2 in ((True, False), (False, False), (True, True), (False, True)):
        sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32",
               "topk_len_ptr": "*i32", "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32",
               "qk_scale": "fp32"}
        sig.update({n: "i32" for n in ints})
        ce = dict(PAGE=64, BLOCK_H=16, BLOCK_N=64, **m.PAIR_OPTIONS, SPLIT=split, HAS_SINK=not split,
                  HAS_TOPK_LEN=True, POW2_SCALES=pow2)
        sig.update({k: "constexpr" for k in ce})
        assert set(sig) == set(fn.arg_names), set(sig) ^ set(fn.arg_names)
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = GluonASTSource(fn, signature={n: sig[n] for n in names}, constexprs=ce, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        try:
            spills = k.asm["sass"].count("STL")
        except Exception:
            spills = 0
        rows.append(["gluon_decode_pair", 90, [16, 64, split, pow2], k.metadata.shared, SHARED_MEMORY_LIMIT[90],
                     spills])
    print(json.dumps(rows))
    """
)


@pytest.mark.skipif(not gluon_available(), reason="this Triton has no Gluon")
def test_gluon_decode_compiles_for_sm90_within_shared_memory():
    rows = run_aot_script(_AOT, timeout=240)
    assert rows
    for kind, arch, cfg, shared, limit, spills in rows:
        assert shared <= limit, f"{kind} sm_{arch} {cfg}: {shared} B shared > {limit} B"
        assert spills == 0, f"{kind} sm_{arch} {cfg}: {spills} local-memory stores"


_AOT_POW2 = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon as m

    fn = m._sparse_mla_decode_gluon_pair_kernel
    ints = ["h_q", "topk", "n_slots", "keys_per_split", "rows_per_batch", "stride_q_row",
            "stride_q_head", "stride_idx_row", "stride_page", "stride_row", "stride_ob", "stride_or",
            "stride_os", "stride_oh", "stride_lb", "stride_lr", "stride_ls", "stride_lh"]
    aligned = ["q_ptr", "kv_ptr", "idx_ptr", "sink_ptr", "topk_len_ptr", "out_ptr", "lse_ptr",
               "stride_q_row", "stride_q_head", "stride_idx_row", "stride_page", "stride_row"]
    out = {}
    for pow2 in (False, True):
        sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32",
               "topk_len_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
        sig.update({n: "i32" for n in ints})
        ce = dict(PAGE=64, BLOCK_H=16, BLOCK_N=64, **m.PAIR_OPTIONS, SPLIT=True, HAS_SINK=False,
                  HAS_TOPK_LEN=False, POW2_SCALES=pow2)
        sig.update({k: "constexpr" for k in ce})
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = GluonASTSource(fn, signature={n: sig[n] for n in names}, constexprs=ce, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        # the window of the first tile's conversion: from the wait for its bytes to its first key store
        lines = ptx.splitlines()
        first_cvt = next(i for i, line in enumerate(lines) if "e4m3x2" in line or "prmt.b32 a," in line)
        start = max(i for i in range(first_cvt) if "mbarrier.try_wait" in lines[i])
        stop = next(i for i in range(first_cvt, len(lines)) if "st.shared.v4" in lines[i])
        out[str(pow2)] = {"e4m3_cvt": ptx.count("e4m3x2"), "bf16x2_mul": ptx.count("mul.rn.bf16x2"),
                          "f32_mul": ptx.count("mul.f32") + ptx.count("mul.rn.f32"),
                          "byte_reads_before_first_store": sum("ld.shared.v2.b32" in line
                                                               for line in lines[start:stop])}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def pair_ptx_counts() -> dict:
    """Counts in the sm_90 PTX of the pair kernel with and without ``POW2_SCALES`` (one compilation each)."""
    if not gluon_available():
        pytest.skip("this Triton has no Gluon")
    return run_aot_script(_AOT_POW2, timeout=240)


def test_gluon_decode_pair_pow2_conversion_takes_the_integer_path(pair_ptx_counts):
    """With ``POW2_SCALES`` the pair kernel converts the keys without the fp8 unit (integer bits times a bf16
    scale); without it, with the fp8 conversions and an fp32 multiply per key element."""
    counts = pair_ptx_counts
    exact, pow2 = counts["False"], counts["True"]
    assert exact["e4m3_cvt"] > 0 and exact["bf16x2_mul"] == 0, exact
    assert pow2["e4m3_cvt"] == 0 and pow2["bf16x2_mul"] > 0, pow2
    assert pow2["f32_mul"] < exact["f32_mul"], (exact, pow2)


def test_gluon_decode_pair_pow2_reads_run_a_group_ahead(pair_ptx_counts):
    """The power-of-two conversion of the pair kernel reads the bytes of the next latent group before it stores
    the keys of the current one (ptxas keeps shared-memory reads below earlier stores, so the order of the source
    is the order of the machine code): before the first key store of a tile, two groups' bytes are in flight."""
    from nsa_backend.kernels.sparse_mla_decode import sm90_gluon as m

    counts = pair_ptx_counts
    # 8-byte reads (DQ_VEC 8): a group of a half tile is 32 rows x 128 bytes over 128 threads
    assert m.PAIR_OPTIONS["DQ_VEC"] == 8
    per_group = 32 * 128 // (128 * 8)
    assert counts["True"]["byte_reads_before_first_store"] >= 2 * per_group, counts


@pytest.mark.parametrize("product", ["mul", "fma"])
def test_decode_pow2_bits_are_e4m3_times_2_pow_minus_120(product):
    """The integer steps of ``POW2_SCALES`` (the selectors and mask of ``pow2_dequant_ptx``, which the sm_90 Gluon
    kernels and the portable tile use) give, for every pair of bytes, the bf16 bits of ``e4m3(b) * 2^-120`` exactly
    (subnormals and signed zeros included), so one bf16 product with ``scale * 2^120`` is ``bf16(e4m3 * scale)``
    for a power-of-two scale."""
    import re

    from nsa_backend.kernels.sparse_mla_prefill.common import pow2_dequant_ptx

    src = pow2_dequant_ptx(product)
    assert f"{product}.rn.bf16x2 $0, a, $3" in src
    sel = [int(x, 16) for x in re.findall(r"prmt\.b32 \w, \$2, 0, (0x[0-9A-Fa-f]+);", src)]
    assert len(sel) == 2 and "0x87F087F0" in src, src
    words = byte_pairs()
    e4m3 = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).float()
    for selector, cols in zip(sel, ((0, 1), (2, 3))):
        halves = prmt_shift_mask(words, selector, 4, 0x87F087F0)
        got = halves.to(torch.int16).view(torch.bfloat16).float() * 2.0**120
        want = e4m3[words[:, list(cols)].long()]
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite])
        assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


def test_pow2_dequant_ptx_refuses_an_unknown_product():
    from nsa_backend.kernels.sparse_mla_prefill.common import pow2_dequant_ptx

    with pytest.raises(ValueError, match=r"product: expected 'mul' or 'fma', got 'add'"):
        pow2_dequant_ptx("add")


@pytest.mark.parametrize("kw, match", [
    ({"pair": True, "block_h": 32}, "pair=True"),
    ({"pair": True, "stages": 2}, "pair=True"),
    ({"pair": True, "pair_options": {"STAGES": 2}}, "pair_options"),
    ({"pair": False, "pair_options": {"DQ_VEC": 8}}, "pair_options"),
])
def test_gluon_decode_pair_override_checked(kw, match):
    """Forcing the pair kernel where it cannot run, or options it does not have, is an error before any
    launch."""
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 656, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode_gluon(q, cache, idx, 0.1, **kw)


def test_gluon_decode_plan_is_shape_only():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import decode_gluon_plan

    plan = decode_gluon_plan(32, 1, 16, 2048, 132)
    assert plan == decode_gluon_plan(32, 1, 16, 2048, 132)
    bh, bn, _, splits, per = plan
    assert (bh, bn) == (16, 64) and splits * per >= 2048 and per % bn == 0
    assert decode_gluon_plan(128, 1, 16, 2048, 132)[3] == 1
    assert decode_gluon_plan(1, 1, 16, 64, 132, num_splits=1)[3:] == (1, 64)
    assert decode_gluon_plan(2, 2, 128, 2048, 132)[0] == 32
    # where the one-wave plan leaves SMs idle (wave_filling_splits): one row takes 16 splits of two 64-key tiles, 80
    # rows three splits (splits-small-batches/sm90-native on an H100: 1.22x and 1.11x)
    assert decode_gluon_plan(1, 1, 16, 2048, 132)[3:] == (16, 128)
    assert decode_gluon_plan(80, 1, 16, 2048, 132)[3] == 3


def test_gluon_decode_support_rules():
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import gluon_decode_supported

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    assert gluon_decode_supported(q, cache, "fp8_ds_mla", 512, 90)
    assert not gluon_decode_supported(q, cache, "fp8_ds_mla", 512, 120)
    assert not gluon_decode_supported(q, cache, "fp8_ds_mla", 512, None)
    assert not gluon_decode_supported(q, torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16), "bf16", 512, 90)
    spaced = torch.zeros(4, 65 * 656 + 8, dtype=torch.uint8)[:, : 64 * 656].view(4, 64, 656)
    assert not gluon_decode_supported(q, spaced, "fp8_ds_mla", 512, 90)


def test_tl_route_off_cuda():
    """Off CUDA (the interpreter) the decode op never takes the Gluon kernel."""
    from nsa_backend.kernels.sparse_mla_decode import _gluon_route

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    assert not _gluon_route(q, torch.zeros(4, 64, 656, dtype=torch.uint8), "fp8_ds_mla", 512, device_arch(q.device))


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)
# ------------------------------------------------------------------------------------------------

HEADS = (16, 16, 32, 64, 128, 20, 48)


def _gluon_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        flags = rnd.random() < 0.5
        c = dict(
            B=rnd.randint(1, 4),
            s_q=rnd.randint(1, 4),
            h_q=rnd.choice(HEADS),
            topk=rnd.choice([1, 63, 64, 200, 512, 1024, 2048]),
            kv_format="fp8_ds_mla",
            scale_format=rnd.choice(["pow2", "arbitrary"]),
            page=rnd.choice([64, 64, 32]),
            num_blocks=rnd.randint(1, 40),
            frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
            sink=flags,
            topk_len=flags or rnd.random() < 0.3,
            pad_pages=rnd.random() < 0.3,  # pages of 656-byte rows stay 16-byte aligned
            seed=1000 + i,
        )
        kw = rnd.choice([{}, {}, {"num_splits": 1}, {"num_splits": 3}, {"stages": 2}, {"block_h": 32}])
        out.append((c, kw))
    return out


def _run_gluon(a: dict, case: str, **kw) -> float:
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

    return run_decode_case(a, case, decode=sparse_mla_decode_gluon, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_gluon_decode_gpu_fuzz():
    errs = [_run_gluon(decode_case(**c), str(c) + str(kw), **kw) for c, kw in _gluon_cases(120, seed=7)]
    print(f"gluon decode fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


def _pair_cases(n: int, seed: int) -> list[tuple[dict, dict]]:
    """Cases of the pair kernel (16-head blocks): odd and even tile counts, a tile count of one (the
    second compute warpgroup idle), partial tiles, one and several splits."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        flags = rnd.random() < 0.5
        c = dict(
            B=rnd.randint(1, 4),
            s_q=rnd.randint(1, 4),
            h_q=rnd.choice((1, 8, 12, 16, 16)),
            topk=rnd.choice([1, 63, 64, 65, 128, 200, 512, 1024, 2048]),
            kv_format="fp8_ds_mla",
            scale_format=rnd.choice(["pow2", "arbitrary"]),
            page=rnd.choice([64, 64, 32]),
            num_blocks=rnd.randint(1, 40),
            frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
            sink=flags,
            topk_len=flags or rnd.random() < 0.3,
            pad_pages=rnd.random() < 0.3,
            seed=5000 + i,
        )
        kw = rnd.choice([{}, {}, {"num_splits": 1}, {"num_splits": 2}, {"num_splits": 3}])
        out.append((c, {**kw, "pair": True}))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_gluon_decode_pair_gpu_fuzz():
    errs = [_run_gluon(decode_case(**c), str(c) + str(kw), **kw) for c, kw in _pair_cases(60, seed=11)]
    print(f"gluon decode pair fuzz: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
@pytest.mark.parametrize("pair", [False, True])
def test_gluon_decode_empty_rows_gpu(pair):
    c = dict(B=2, s_q=2, h_q=16, topk=128, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
             num_blocks=4, frac_invalid=0.0, sink=True, topk_len=False, pad_pages=False, seed=3)
    for kw in ({"pair": pair}, {"num_splits": 1, "pair": pair}, {"num_splits": 2, "pair": pair}):
        a = decode_case(**c)
        a["indices"][0] = -1
        a["indices"][1, 1] = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]  # == n_slots: invalid
        _run_gluon(a, f"empty rows {kw}", **kw)
        from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

        out, lse = sparse_mla_decode_gluon(**a, **kw)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
@pytest.mark.parametrize("pair", [False, True])
def test_gluon_decode_cuda_graph(pair):
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

    c = dict(B=8, s_q=1, h_q=16, topk=512, kv_format="fp8_ds_mla", scale_format="arbitrary", page=64,
             num_blocks=64, frac_invalid=0.1, sink=False, topk_len=True, pad_pages=False, seed=5)
    a = decode_case(**c)
    want = sparse_mla_decode_gluon(**a, pair=pair)
    g, got = capture(lambda: sparse_mla_decode_gluon(**a, pair=pair))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_decode_op_routes_few_heads_to_gluon(monkeypatch):
    """``sparse_mla_decode_triton`` takes the Gluon kernel for the head counts listed, the tl kernel
    with ``NSA_BACKEND_GLUON=0`` (both match the reference)."""
    from nsa_backend.kernels.sparse_mla_decode import GLUON_DECODE_HEADS, sparse_mla_decode_triton
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

    c = dict(B=3, s_q=2, h_q=16, topk=300, kv_format="fp8_ds_mla", scale_format="pow2", page=64,
             num_blocks=16, frac_invalid=0.1, sink=True, topk_len=True, pad_pages=False, seed=9)
    a = decode_case(**c)
    monkeypatch.setenv("NSA_BACKEND_GLUON", "1")
    got = sparse_mla_decode_triton(**a)
    if 16 in GLUON_DECODE_HEADS:
        want = sparse_mla_decode_gluon(**a)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    tl_out = sparse_mla_decode_triton(**a)
    r_out, r_lse, r_abs = _fp32_reference_decode(a)
    for out, lse in (got, tl_out):
        _check_out("out", out.view(r_out.shape), r_out, "route", r_abs)
        _check_stat("lse", lse, r_lse, "route")


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90_gluon(), reason="the Gluon decode kernel runs on sm_90")
def test_gluon_decode_pair_pow2_scales_same_numbers_gpu():
    """``kv_scale_format="pow2"`` on caches written with power-of-two scales: bit-identical to the exact
    conversion (the same keys) over the pair cases, and within tolerance through the public op."""
    import nsa_backend as nb
    from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import sparse_mla_decode_gluon

    for c, kw in _pair_cases(16, seed=13):
        a = decode_case(**{**c, "scale_format": "pow2"})
        case = str(c) + str(kw)
        want_o, want_l = sparse_mla_decode_gluon(**a, **kw)
        got_o, got_l = sparse_mla_decode_gluon(**a, **kw, kv_scale_format="pow2")
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), case
    # the public op: 32 rows of 16 heads take the pair kernel
    big = dict(B=16, s_q=2, h_q=16, topk=512, kv_format="fp8_ds_mla", page=64, num_blocks=64, frac_invalid=0.1,
               sink=True, topk_len=True, pad_pages=False, seed=91)
    for c in [big] + [c for c, _ in _pair_cases(6, seed=17)]:
        a = decode_case(**{**c, "scale_format": "pow2"})
        run_decode_case(a, str(c), decode=lambda **x: nb.sparse_mla_decode(**x, kv_scale_format="pow2",
                                                                           impl="triton"))
