"""DeepSeek-V4 KV cache ops (``pack_fp8_ds_mla_v4``, ``unpack_fp8_ds_mla_v4``,
``write_fp8_ds_mla_v4_cache``): the Triton kernels byte for byte against ``nsa_backend.reference``
(in the interpreter on CPU), the reference against a decoder written here from the layout (block-split
pages, UE8M0 scales, pad byte), a float64 norm / rotation, the scale formula's edge cases, pack ->
unpack within the e4m3 bound, skipped slots, page sizes 64 and 256, and bad inputs. AOT: the kernels
compile for sm_80 ... sm_121. GPU: a seeded fuzz of 300 cases.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

import nsa_backend as nb
from nsa_backend import reference as ref
from tests.ops._aot import run_aot_script

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
TOKEN, DATA = 584, 576


def _rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, 512]`` bf16 rows over many magnitudes, with edge values in the first rows."""
    x = torch.randn(n, 512, generator=gen) * torch.logspace(-7, 4, n)[:, None]
    x[0] = 0.0                              # all-zero groups: the 1e-4 floor
    x[1, :64] = -0.0
    x[1, 64:128] = 1e-9                     # amax below the floor
    x[2, :448] = 448.0 * 2.0 ** -5          # amax / 448 an exact power of two
    x[2, 64:128] *= -1
    x[3, :64] = torch.linspace(-1, 1, 64)   # e4m3 subnormal codes
    x[3, 5] = 448.0
    return x.bfloat16()


def _rope_inputs(T: int, gen: torch.Generator, dtype=torch.float32):
    n_pos = 40
    theta = torch.arange(n_pos)[:, None] * (10000.0 ** (-torch.arange(32) / 32.0))[None, :]
    cs = torch.cat([theta.cos(), theta.sin()], dim=1).to(dtype)
    pos = torch.randint(0, n_pos, (T,), generator=gen)
    return pos, cs


def _cache(num_blocks: int, page: int, pad: int, gen: torch.Generator, four_d: bool = False):
    """Random bytes, pages ``page * 584 + pad`` apart: (whole buffer, cache view)."""
    stride = page * TOKEN + pad
    buf = torch.randint(0, 256, (num_blocks, stride), generator=gen, dtype=torch.uint8)
    view = buf[:, :page * TOKEN].view(num_blocks, page, TOKEN)
    return buf, (view.unsqueeze(2) if four_d else view)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)  # -0.0 and +0.0 differ here, unlike torch.equal on values


def _same_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal values, NaN where the reference has NaN (any NaN: a GPU writes its canonical NaN where a
    CPU keeps the payload, and the random bytes of unwritten slots decode to NaNs)."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(_bf16_bits(got)[~nan], _bf16_bits(want)[~nan])


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference (byte for byte)
# ----------------------------------------------------------------------------------------------

def test_pack_triton_matches_reference():
    x = _rows(12, torch.Generator().manual_seed(0)).to(DEV)
    got = nb.pack_fp8_ds_mla_v4(x, impl="triton")
    want = nb.pack_fp8_ds_mla_v4(x, impl="reference")
    assert got.shape == (12, TOKEN) and got.dtype == torch.uint8
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("shape", ["rows", "paged3d", "paged4d"])
def test_unpack_triton_matches_reference(shape):
    g = torch.Generator().manual_seed(1)
    if shape == "rows":
        packed = nb.pack_fp8_ds_mla_v4(_rows(6, g), impl="reference").to(DEV)
    else:
        buf, packed = _cache(2, 3, 24, g, four_d=shape == "paged4d")
        nb.write_fp8_ds_mla_v4_cache(_rows(6, g), packed, torch.arange(6), impl="reference")
        packed = packed.to(DEV) if DEV == "cpu" else buf.to(DEV)[:, :3 * TOKEN].view(packed.shape)
    got = nb.unpack_fp8_ds_mla_v4(packed, impl="triton")
    want = nb.unpack_fp8_ds_mla_v4(packed, impl="reference")
    assert got.shape == (*packed.shape[:-1], 512) and got.dtype == torch.bfloat16
    assert torch.equal(_bf16_bits(got), _bf16_bits(want))


WRITE_CASES = [
    # page size, norm, rope, cos/sin dtype, 4-D cache, slot dtype
    pytest.param(64, True, True, torch.float32, False, torch.int64, id="p64-norm-rope-f32-3d-i64"),
    pytest.param(256, True, True, torch.bfloat16, True, torch.int32, id="p256-norm-rope-bf16-4d-i32"),
    pytest.param(64, False, True, torch.float32, True, torch.int32, id="p64-rope-only"),
    pytest.param(256, True, False, None, False, torch.int64, id="p256-norm-only"),
    pytest.param(64, False, False, None, False, torch.int32, id="p64-quant-only"),
]


@pytest.mark.parametrize("page, norm, rope, cs_dtype, four_d, slot_dtype", WRITE_CASES)
def test_write_triton_matches_reference(page, norm, rope, cs_dtype, four_d, slot_dtype):
    g = torch.Generator().manual_seed(2)
    T, num_blocks = 10, 2
    kv = _rows(T, g)
    w = (torch.rand(512, generator=g) + 0.5).bfloat16() if norm else None
    pos, cs = _rope_inputs(T, g, cs_dtype) if rope else (None, None)
    buf, cache = _cache(num_blocks, page, 64, g, four_d)
    n_slots = num_blocks * page
    slots = torch.randperm(n_slots, generator=g)[:T]
    slots[1] = -1
    slots[4] = n_slots + 5  # out of range: skipped
    if rope:
        pos[6] = 1000  # outside the cos/sin cache: skipped
    want_buf = buf.clone()
    want = want_buf[:, :page * TOKEN].view(cache.shape)
    ref.write_fp8_ds_mla_v4_cache(kv, want, slots.to(slot_dtype), w, pos, cs, 1e-6)
    dev = lambda t: None if t is None else t.to(DEV)
    got_buf = buf.to(DEV)
    got = got_buf[:, :page * TOKEN].view(cache.shape)
    nb.write_fp8_ds_mla_v4_cache(kv.to(DEV), got, dev(slots.to(slot_dtype)), dev(w), dev(pos), dev(cs), 1e-6,
                                 impl="triton")
    assert torch.equal(got_buf.cpu(), want_buf), f"{(got_buf.cpu() != want_buf).sum().item()} bytes differ"
    # Only the valid tokens' 584 bytes changed (slot -1, slot >= n_slots, position >= 40 left alone).
    changed = (want_buf != buf)
    written = torch.zeros_like(changed)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < n_slots and (pos is None or pos[t] < cs.shape[0]):
            b, i = divmod(s, page)
            written[b, i * DATA:(i + 1) * DATA] = True
            written[b, page * DATA + i * 8:page * DATA + (i + 1) * 8] = True
    assert not (changed & ~written).any(), "bytes outside the written tokens changed"
    assert written.sum() == 584 * (T - (3 if rope else 2))


def test_empty_inputs():
    assert nb.pack_fp8_ds_mla_v4(torch.zeros(0, 512, dtype=torch.bfloat16, device=DEV), impl="triton").shape == (0, 584)
    cache = torch.zeros(1, 64, TOKEN, dtype=torch.uint8, device=DEV)
    nb.write_fp8_ds_mla_v4_cache(torch.zeros(0, 512, dtype=torch.bfloat16, device=DEV), cache,
                                 torch.zeros(0, dtype=torch.int64, device=DEV), impl="triton")
    assert not cache.any()


# ----------------------------------------------------------------------------------------------
# The reference against the layout and the math, written out here
# ----------------------------------------------------------------------------------------------

def _decode_token(page_bytes: torch.Tensor, page: int, i: int) -> tuple[list[float], list[int]]:
    """512 values and the 8 scale bytes of token ``i`` of one page, read from the byte positions."""
    data = page_bytes[i * DATA:(i + 1) * DATA]
    sb = page_bytes[page * DATA + i * 8:page * DATA + (i + 1) * 8].tolist()
    codes = data[:448].view(FP8).float().tolist()
    nope = [c * 2.0 ** (sb[d // 64] - 127) for d, c in enumerate(codes)]
    rope = data[448:].clone().view(torch.bfloat16).float().tolist()
    return nope + rope, sb


def test_reference_layout_norm_and_rope():
    """Bytes sit where the block-split layout puts them, and decode to the float64 norm + rotation."""
    g = torch.Generator().manual_seed(3)
    page, T, eps = 64, 5, 1e-6
    kv = (torch.randn(T, 512, generator=g) * 3).bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).bfloat16()
    pos, cs = _rope_inputs(T, g)
    buf, cache = _cache(2, page, 0, g)
    slots = torch.tensor([0, 63, 64, 100, 127])
    nb.write_fp8_ds_mla_v4_cache(kv, cache, slots, w, pos, cs, eps, impl="reference")
    x = kv.double()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()
    e, o = y[:, 448::2], y[:, 449::2]
    c, s = cs[pos, :32].double(), cs[pos, 32:].double()
    pair = (e.abs() + o.abs()).repeat_interleave(2, dim=1)  # [T, 64]: what each rotated value mixes
    y[:, 448::2], y[:, 449::2] = e * c - o * s, e * s + o * c
    for t, slot in enumerate(slots.tolist()):
        vals, sb = _decode_token(buf[slot // page], page, slot % page)
        assert sb[7] == 0, f"token {t}: pad byte {sb[7]}"
        for grp in range(7):
            # The smallest power of two keeping the group within +-448 (up to the bf16 rounding of y).
            amax = max(y[t, grp * 64:(grp + 1) * 64].abs().max().item(), 1e-4)
            scale = 2.0 ** (sb[grp] - 127)
            assert 448 * scale >= amax * (1 - 2.0 ** -7) and 448 * scale / 2 < amax * (1 + 2.0 ** -7), (t, grp)
        got = torch.tensor(vals, dtype=torch.float64)
        err = (got - y[t]).abs()
        scale = torch.tensor([2.0 ** (sb[d // 64] - 127) for d in range(448)], dtype=torch.float64)
        # e4m3: half an ulp (2^-4 relative, 2^-10 * scale in the subnormal range), plus bf16 steps.
        assert (err[:448] <= y[t, :448].abs() * (2.0 ** -4 + 2.0 ** -7) + scale * 2.0 ** -9).all(), t
        # bf16 rounding of the normalised pair, then of the rotated value.
        assert (err[448:] <= pair[t] * 2.0 ** -7 + 1e-6).all(), t


def test_scale_edge_cases():
    x = torch.zeros(4, 512)
    x[1, :64] = 448.0 * 2.0 ** -3               # amax / 448 = 2^-3 exactly: no rounding up
    x[1, 64:128] = -448.0 * 2.0 ** 4
    x[1, 128:192] = 448.0 * 2.0 ** -3 * (1 + 2.0 ** -7)  # just above: the next power of two
    x[1, 192] = 1e-4                             # amax == floor
    x[2, :448] = torch.linspace(-448, 448, 64).repeat(7)  # every group spans +-448: scale 1
    x[3, :448] = 448.0 * 2.0 ** 10
    x = x.bfloat16()
    for impl in ("reference", "triton"):
        p = nb.pack_fp8_ds_mla_v4(x.to(DEV), impl=impl).cpu()
        floor = 127 + math.ceil(math.log2(1e-4 / 448))  # 105
        assert p[0, 576:].tolist() == [floor] * 7 + [0], impl       # all zero: scale from 1e-4
        assert not p[0, :576].any(), impl
        assert p[1, 576:].tolist() == [124, 131, 125, floor, floor, floor, floor, 0], (impl, p[1, 576:])
        assert p[1, 0] == 0x7E and p[1, 64] == 0xFE, impl              # +-448 codes
        assert p[2, 576:583].tolist() == [127] * 7, impl
        assert p[2, 0] == 0xFE and p[2, 447] == 0x7E and p[2, 64] == 0xFE, impl
        assert p[3, 576:583].tolist() == [137] * 7 and (p[3, :448] == 0x7E).all(), impl


def test_round_trip_within_e4m3_bound():
    x = _rows(16, torch.Generator().manual_seed(4)).to(DEV)
    packed = nb.pack_fp8_ds_mla_v4(x, impl="triton")
    back = nb.unpack_fp8_ds_mla_v4(packed, impl="triton")
    xs, ys = x.double().cpu(), back.double().cpu()
    scale = ref.ue8m0_to_float(packed[:, 576:583].cpu()).double().repeat_interleave(64, dim=1)  # [N, 448]
    err = (xs[:, :448] - ys[:, :448]).abs()
    bound = xs[:, :448].abs() * 2.0 ** -4 + scale * 2.0 ** -10
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert torch.equal(_bf16_bits(back[:, 448:].cpu()), _bf16_bits(x[:, 448:].cpu())), "rope not exact"
    # Scales are powers of two, and the smallest that keeps every value within +-448.
    amax = xs[:, :448].abs().view(-1, 7, 64).amax(-1).clamp(min=1e-4)
    s = ref.ue8m0_to_float(packed[:, 576:583].cpu()).double()
    assert (amax / s <= 448).all() and (amax / (s / 2) > 448).all()


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _ok():
    kv = torch.randn(3, 512).bfloat16()
    cache = torch.zeros(2, 64, TOKEN, dtype=torch.uint8)
    return dict(kv=kv, kv_cache=cache, slot_mapping=torch.tensor([0, 1, 2]), norm_weight=torch.ones(512),
                positions=torch.tensor([0, 1, 2]), cos_sin_cache=torch.randn(8, 64))


BAD_WRITE = [
    pytest.param({"kv": torch.randn(3, 512)}, TypeError, "kv: expected dtype bfloat16", id="kv-dtype"),
    pytest.param({"kv": torch.randn(3, 576).bfloat16()}, ValueError, "kv: expected shape", id="kv-576"),
    pytest.param({"kv_cache": torch.zeros(2, 64, 656, dtype=torch.uint8)}, ValueError, "584", id="cache-656"),
    pytest.param({"kv_cache": torch.zeros(2, 64, 584)}, TypeError, "kv_cache: expected dtype uint8", id="cache-f32"),
    pytest.param({"kv_cache": torch.zeros(2, 64, 2, 584, dtype=torch.uint8)}, ValueError, "kv_cache", id="cache-h2"),
    pytest.param({"kv_cache": torch.zeros(64, 2, 584, dtype=torch.uint8).transpose(0, 1)}, ValueError,
                 "contiguous", id="cache-strided-page"),
    pytest.param({"kv_cache": torch.zeros(2, 64 * 584 + 1, dtype=torch.uint8)[:, :64 * 584].view(2, 64, 584)},
                 ValueError, "even page stride", id="cache-odd-stride"),
    pytest.param({"kv_cache": torch.zeros(2 * 64 * 584 + 1, dtype=torch.uint8)[1:].view(2, 64, 584)},
                 ValueError, "even start address", id="cache-odd-address"),
    pytest.param({"kv_cache": torch.zeros(2, 0, 584, dtype=torch.uint8)}, ValueError, "page_size", id="page-0"),
    pytest.param({"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, TypeError, "slot_mapping", id="slots-float"),
    pytest.param({"slot_mapping": torch.tensor([0, 1])}, ValueError, "slot_mapping: expected shape", id="slots-len"),
    pytest.param({"norm_weight": torch.ones(448)}, ValueError, "norm_weight", id="weight-shape"),
    pytest.param({"positions": None}, ValueError, "both", id="rope-half"),
    pytest.param({"positions": torch.tensor([0, 1])}, ValueError, "positions: expected shape", id="pos-len"),
    pytest.param({"cos_sin_cache": torch.randn(8, 32)}, ValueError, "cos_sin_cache", id="cs-dim"),
    pytest.param({"eps": -1.0}, ValueError, "eps", id="eps-neg"),
    pytest.param({"impl": "flash_mla"}, ValueError, "impl", id="impl"),
]


@pytest.mark.parametrize("change, exc, text", BAD_WRITE)
def test_write_rejects_bad_inputs(change, exc, text):
    args = {**_ok(), **change}
    impl = args.pop("impl", "reference")
    before = args["kv_cache"].clone()
    with pytest.raises(exc, match=text):
        nb.write_fp8_ds_mla_v4_cache(**args, impl=impl)
    assert torch.equal(args["kv_cache"], before)


def test_pack_unpack_reject_bad_inputs():
    with pytest.raises(ValueError, match="kv: expected shape"):
        nb.pack_fp8_ds_mla_v4(torch.zeros(2, 576, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="kv: expected dtype bfloat16"):
        nb.pack_fp8_ds_mla_v4(torch.zeros(2, 512, dtype=torch.float16))
    with pytest.raises(ValueError, match="packed: expected shape"):
        nb.unpack_fp8_ds_mla_v4(torch.zeros(2, 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed: expected a 2-D or 3-D or 4-D"):
        nb.unpack_fp8_ds_mla_v4(torch.zeros(584, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------
# AOT and GPU
# ----------------------------------------------------------------------------------------------

_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels.aot import TARGET_ARCHS
    from nsa_backend.kernels.aot_registry import shipped_jobs
    rows = []
    for job in shipped_jobs(TARGET_ARCHS, ["fp8_ds_mla_v4"]):
        r = job.compile()
        rows.append([job.kind, job.arch, job.config, r.shared_bytes, r.fits])
    print(json.dumps(rows))
""")


def test_aot_kernels_all_archs():
    from nsa_backend.kernels.aot import TARGET_ARCHS

    rows = run_aot_script(_AOT_SCRIPT, timeout=600)
    assert {r[1] for r in rows} == set(TARGET_ARCHS)
    assert len(rows) == 3 * len(TARGET_ARCHS) and all(r[-1] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(3))
def test_gpu_fuzz(shard):
    """300 seeded cases (in 3 shards): random sizes, magnitudes, page sizes, norm / rope on or off, slots with -1."""
    for i in range(shard, 300, 3):
        g = torch.Generator().manual_seed(1000 + i)
        T = int(torch.randint(1, 700, (1,), generator=g))
        page = (64, 256)[i % 2]
        norm, rope = bool(i % 3), bool(i % 4)
        kv = (torch.randn(T, 512, generator=g)
              * torch.logspace(-6, 4, T)[torch.randperm(T, generator=g)][:, None]).bfloat16()
        w = (torch.rand(512, generator=g) * 2).to((torch.bfloat16, torch.float32)[i % 2]) if norm else None
        pos, cs = _rope_inputs(T, g, (torch.float32, torch.bfloat16)[i % 2]) if rope else (None, None)
        blocks = T // page + 2
        slots = torch.randperm(blocks * page, generator=g)[:T]
        slots[torch.rand(T, generator=g) < 0.1] = -1
        buf, cache = _cache(blocks, page, 576 - (page * TOKEN) % 576, g)
        want = buf.clone()
        # The reference runs on CPU (exact float32 division; see test_fp8_ds_mla.py).
        ref.write_fp8_ds_mla_v4_cache(kv, want[:, :page * TOKEN].view(cache.shape), slots, w, pos, cs, 1e-6)
        got = buf.cuda()
        cuda = lambda t: None if t is None else t.cuda()
        nb.write_fp8_ds_mla_v4_cache(kv.cuda(), got[:, :page * TOKEN].view(cache.shape), slots.cuda(), cuda(w),
                                     cuda(pos), cuda(cs), 1e-6, impl="triton")
        assert torch.equal(got.cpu(), want), f"case {i}: {(got.cpu() != want).sum().item()} bytes differ"
        packed = nb.pack_fp8_ds_mla_v4(kv.cuda(), impl="triton")
        assert torch.equal(packed.cpu(), ref.pack_fp8_ds_mla_v4(kv)), f"case {i}: pack differs"
        un = nb.unpack_fp8_ds_mla_v4(got[:, :page * TOKEN].view(cache.shape), impl="triton")
        want_un = ref.unpack_fp8_ds_mla_v4(want[:, :page * TOKEN].view(cache.shape))
        assert _same_bf16(un.cpu(), want_un), f"case {i}: unpack differs"
