"""Sparse MLA with FlashMLA's DeepSeek-V4 contract: decode over the 584-byte block-split cache
(``kv_format="fp8_ds_mla_v4"``) with a second key list (``extra_kv_cache`` / ``extra_indices`` /
``extra_topk_length``), and prefill with ``d_qk = 512`` over bf16 rows.

The reference is checked against a float64 dense attention written here (a mask of key counts built
from the index lists over the whole dequantised caches): -1 and out-of-range slots, ``topk_length`` /
``extra_topk_length`` truncation, rows without keys, sinks, h_q 1..128, topk not a power of two. The
Triton kernel runs against the reference in the interpreter; bad inputs fail before any kernel; the
router keeps V4 calls off kernels of other cache formats.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

import nsa_backend as nb
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import router

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V4 = "fp8_ds_mla_v4"


def _v4_cache(num_blocks: int, page: int, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """Block-split V4 cache ``uint8 [num_blocks, page, 584]`` of random tokens, pages ``pad`` bytes apart
    beyond their size (``stride(0) = page * 584 + pad``)."""
    kv = (torch.randn(num_blocks * page, 512, generator=gen) * 2).bfloat16()
    rows = nb.pack_fp8_ds_mla_v4(kv, impl="reference").view(num_blocks, page, 584)
    buf = torch.full((num_blocks, page * 584 + pad), 0xFF, dtype=torch.uint8)  # NaN bytes in the padding
    buf[:, :page * 576] = rows[:, :, :576].reshape(num_blocks, -1)
    buf[:, page * 576:page * 584] = rows[:, :, 576:].reshape(num_blocks, -1)
    return buf[:, :page * 584].view(num_blocks, page, 584).to(DEV)


def _indices(B: int, s_q: int, topk: int, n_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Slots with duplicates, -1 and out-of-range entries."""
    idx = torch.randint(0, n_slots, (B, s_q, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(B, s_q, topk, generator=gen) < 0.15] = -1
    idx[torch.rand(B, s_q, topk, generator=gen) < 0.05] = n_slots + 3
    return idx.to(DEV)


def _naive_decode(q, lists, sm_scale, sink):
    """Dense float64 attention: every slot of every cache is a key, weighted by how often the
    (truncated) index lists name it; one softmax over all caches."""
    B, s_q, h_q, _ = q.shape
    out = torch.zeros(B, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.zeros(B, h_q, s_q, dtype=torch.float64)
    keys = [nb.unpack_fp8_ds_mla_v4(c.cpu(), impl="reference").reshape(-1, 512).double() for c, _, _ in lists]
    for b in range(B):
        for s in range(s_q):
            logits, weights, values = [], [], []
            for k, (_, idx, length) in zip(keys, lists):
                counts = torch.zeros(k.shape[0], dtype=torch.float64)
                row = idx[b, s].cpu().tolist()
                n = len(row) if length is None else int(length[b])
                for slot in row[:n]:
                    if 0 <= slot < k.shape[0]:
                        counts[slot] += 1
                logits.append(q[b, s].cpu().double() @ k.T * sm_scale)  # [h_q, n_slots]
                weights.append(counts)
                values.append(k)
            lg, w, v = torch.cat(logits, 1), torch.cat(weights), torch.cat(values)
            if w.sum() == 0:
                lse[b, :, s] = float("inf")
                continue
            lg = lg.masked_fill(w[None, :] == 0, float("-inf"))
            m = lg.amax(1, keepdim=True)
            e = torch.exp(lg - m) * w[None, :]
            total = e.sum(1)
            o = (e @ v) / total[:, None]
            lse_bs = m[:, 0] + torch.log(total)
            if sink is not None:
                o = o * torch.sigmoid(lse_bs - sink.cpu().double())[:, None]
            out[b, s], lse[b, :, s] = o, lse_bs
    return out, lse


def _case(h_q: int, topk: int, extra_topk: int | None, seed: int, B: int = 3, s_q: int = 2, sinks: bool = True):
    gen = torch.Generator().manual_seed(seed)
    main = _v4_cache(3, 8, gen, pad=40)
    q = torch.randn(B, s_q, h_q, 512, generator=gen).bfloat16().to(DEV)
    idx = _indices(B, s_q, topk, 24, gen)
    # request 0 has no main keys; the lengths truncate the others
    lens = torch.tensor([0] + [int(x) for x in torch.randint(1, topk + 1, (B - 1,), generator=gen)],
                        dtype=torch.int32, device=DEV)
    kw = dict(kv_format=V4, topk_length=lens,
              attn_sink=torch.randn(h_q, generator=gen).to(DEV) if sinks else None)
    if extra_topk is not None:
        extra = _v4_cache(2, 4, gen)
        e_idx = _indices(B, s_q, extra_topk, 8, gen)
        # request 0 has no extra keys either (an empty row); request 1 uses all of its extra list
        e_lens = torch.tensor([0, extra_topk] + [int(x) for x in torch.randint(0, extra_topk + 1, (B - 2,),
                                                                                  generator=gen)],
                              dtype=torch.int32, device=DEV)
        kw.update(extra_kv_cache=extra, extra_indices=e_idx, extra_topk_length=e_lens)
    return q, main, idx, kw


def _lists(main, idx, kw):
    lists = [(main, idx, kw["topk_length"])]
    if kw.get("extra_indices") is not None:
        lists.append((kw["extra_kv_cache"], kw["extra_indices"], kw["extra_topk_length"]))
    return lists


@pytest.mark.parametrize("h_q", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("topk,extra_topk", [(12, 7), (5, None)])
def test_decode_reference_matches_naive(h_q, topk, extra_topk):
    q, main, idx, kw = _case(h_q, topk, extra_topk, seed=h_q * 7 + topk)
    out, lse = nb.sparse_mla_decode(q, main, idx, 0.06, impl="reference", **kw)
    want_out, want_lse = _naive_decode(q, _lists(main, idx, kw), 0.06, kw["attn_sink"])
    assert out.shape == (3, 2, h_q, 512) and out.dtype == torch.bfloat16 and lse.shape == (3, h_q, 2)
    torch.testing.assert_close(out.cpu().double(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-4, rtol=1e-4)
    assert torch.isinf(lse[0]).all() and not out[0].any()  # request 0: no key at all -> zero rows, lse +inf
    assert torch.isfinite(lse[1:]).all()


def test_decode_extra_keys_change_the_result():
    q, main, idx, kw = _case(4, 12, 7, seed=3)
    with_extra, _ = nb.sparse_mla_decode(q, main, idx, 0.06, impl="reference", **kw)
    kw.update(extra_kv_cache=None, extra_indices=None, extra_topk_length=None)
    without, _ = nb.sparse_mla_decode(q, main, idx, 0.06, impl="reference", **kw)
    assert (with_extra[1].float() - without[1].float()).abs().max() > 1e-2


@pytest.mark.parametrize("h_q", [1, 3, 64, 128])
def test_prefill_v4_reference_matches_naive(h_q):
    """V4 prefill: FlashMLA's ``flash_mla_sparse_fwd`` with d_qk = d_v = 512 over bf16 rows."""
    gen = torch.Generator().manual_seed(h_q)
    s_q, s_kv, topk = 4, 30, 11
    q = torch.randn(s_q, h_q, 512, generator=gen).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16()
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    idx[0, 0, 2] = -1
    idx[1, 0, 0] = s_kv
    lens = torch.tensor([0, topk, 3, 7], dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    out, mx, lse = nb.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink, topk_length=lens, impl="reference")
    k = kv[:, 0].double()
    for i in range(s_q):
        counts = torch.zeros(s_kv, dtype=torch.float64)
        for slot in idx[i, 0, :lens[i]].tolist():
            if 0 <= slot < s_kv:
                counts[slot] += 1
        if counts.sum() == 0:
            assert not out[i].any() and torch.isinf(lse[i]).all()
            continue
        lg = (q[i].double() @ k.T * 0.05).masked_fill(counts[None, :] == 0, float("-inf"))
        e = torch.exp(lg - lg.amax(1, keepdim=True)) * counts
        want_lse = lg.amax(1) + torch.log(e.sum(1))
        want = (e @ k) / e.sum(1, keepdim=True) * torch.sigmoid(want_lse - sink.double())[:, None]
        torch.testing.assert_close(out[i].double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[i].double(), want_lse, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mx[i].double(), lg.amax(1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("h_q,topk,extra_topk,sinks", [(1, 12, 7, True), (3, 40, None, False), (20, 5, 9, True)])
def test_triton_matches_reference(h_q, topk, extra_topk, sinks):
    q, main, idx, kw = _case(h_q, topk, extra_topk, seed=11 + h_q, sinks=sinks)
    out, lse = nb.sparse_mla_decode(q, main, idx, 0.06, impl="triton", **kw)
    want_out, want_lse = nb.sparse_mla_decode(q, main, idx, 0.06, impl="reference", **kw)
    torch.testing.assert_close(out.float(), want_out.float(), atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_triton_without_lengths_or_sink():
    q, main, idx, kw = _case(2, 9, 6, seed=5, sinks=False)
    kw.update(topk_length=None, extra_topk_length=None)
    out, lse = nb.sparse_mla_decode(q, main, idx, 0.06, impl="triton", **kw)
    want_out, want_lse = nb.sparse_mla_decode(q, main, idx, 0.06, impl="reference", **kw)
    torch.testing.assert_close(out.float(), want_out.float(), atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native_fp8", [True, False], ids=["e4m3-type", "integer-decoding"])
def test_single_key_returns_the_unpacked_row(native_fp8):
    """With one valid key the output row is that key's dequantised row exactly: the kernel decodes every e4m3
    code (subnormals, the largest values) and scale byte (0 is the subnormal 2^-127, whose products are bf16
    subnormals) exactly as the unpack, on both decoding paths."""
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_v4_decode_triton

    gen = torch.Generator().manual_seed(3)
    blocks, page = 2, 64
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the two NaNs
    data = codes[torch.randint(0, codes.numel(), (blocks * page, 448), generator=gen)]
    data[:2, :codes.numel()] = codes  # the first two tokens hold every code
    scales = torch.randint(0, 141, (blocks * page, 8), generator=gen, dtype=torch.uint8)  # finite q . k
    scales[0, :7] = torch.tensor([0, 1, 2, 60, 127, 139, 140], dtype=torch.uint8)
    rope = torch.randn(blocks * page, 64, generator=gen).bfloat16().view(torch.uint8)
    cache = torch.empty(blocks, page * 584, dtype=torch.uint8)
    cache[:, :page * 576] = torch.cat([data, rope.view(-1, 128)], 1).view(blocks, -1)
    cache[:, page * 576:] = scales.view(blocks, -1)
    cache = cache.view(blocks, page, 1, 584).to(DEV)
    want = nb.unpack_fp8_ds_mla_v4(cache.cpu(), impl="reference").view(-1, 512)
    slots = torch.tensor([0, 1, 5, 64, 70, 127], dtype=torch.int32)
    q = (torch.randn(1, slots.numel(), 16, 512, generator=gen) * 1e-9).bfloat16().to(DEV)
    idx = torch.full((1, slots.numel(), 3), -1, dtype=torch.int32)
    idx[0, :, 1] = slots  # one valid key per query row, between two skipped slots
    out, _ = sparse_mla_v4_decode_triton(q, cache, idx.to(DEV), 1.0, native_fp8=native_fp8)
    for i, slot in enumerate(slots.tolist()):
        # exact values (the sum that forms the output gives -0.0 keys a +0.0)
        assert torch.equal(out[0, i].cpu().float(), want[slot][None].expand(16, 512).float()), slot


def _bad(**change):
    q, main, idx, kw = _case(2, 6, 4, seed=1)
    args = dict(q=q, kv_cache=main, indices=idx, sm_scale=0.06, **kw)
    args.update(change)
    return args


BAD = [
    ("q head dim", dict(q=torch.zeros(3, 2, 2, 576, dtype=torch.bfloat16, device=DEV)), ValueError,
     "fp8_ds_mla_v4' stores 512-dim"),
    ("cache width", dict(kv_cache=torch.zeros(3, 8, 656, dtype=torch.uint8, device=DEV)), ValueError,
     "kv_cache: expected fp8_ds_mla_v4 shape"),
    ("cache dtype", dict(kv_cache=torch.zeros(3, 8, 584, dtype=torch.int8, device=DEV)), TypeError,
     "kv_cache: expected dtype uint8"),
    ("extra cache width", dict(extra_kv_cache=torch.zeros(2, 4, 576, dtype=torch.uint8, device=DEV)), ValueError,
     "extra_kv_cache: expected fp8_ds_mla_v4 shape"),
    ("extra without cache", dict(extra_kv_cache=None), ValueError, "extra_kv_cache: expected a tensor"),
    ("cache without extra", dict(extra_indices=None), ValueError, "extra_indices: expected a tensor"),
    ("extra indices batch", dict(extra_indices=torch.zeros(2, 2, 4, dtype=torch.int32, device=DEV)), ValueError,
     "extra_indices: expected shape"),
    ("extra indices dtype", dict(extra_indices=torch.zeros(3, 2, 4, dtype=torch.int64, device=DEV)), TypeError,
     "extra_indices: expected dtype int32"),
    ("extra length shape", dict(extra_topk_length=torch.zeros(2, dtype=torch.int32, device=DEV)), ValueError,
     "extra_topk_length: expected shape"),
    ("scale format", dict(kv_scale_format="pow2"), ValueError, "kv_scale_format: only for kv_format 'fp8_ds_mla'"),
]


@pytest.mark.parametrize("name,change,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, change, exc, match):
    with pytest.raises(exc, match=match):
        nb.sparse_mla_decode(**_bad(**change), impl="reference")


def test_extra_list_needs_the_v4_format():
    q = torch.zeros(1, 1, 2, 576, dtype=torch.bfloat16, device=DEV)
    cache = torch.zeros(1, 64, 656, dtype=torch.uint8, device=DEV)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="extra_indices: a second key list is only for kv_format"):
        nb.sparse_mla_decode(q, cache, idx, 0.1, extra_indices=idx, impl="reference")


FEATURES = {"num_heads": 64, "d_qk": 512, "topk": 512, "s_q": 1, "kv_format": V4, "page_size": 64}


@pytest.mark.parametrize(("arch", "expected"), [("sm80", "triton"), ("sm89", "triton"), ("sm90", "flash_mla"),
                                                ("sm100", "flash_mla"), ("sm120", "triton")])
def test_router_sends_v4_to_flash_mla_or_its_own_triton_kernel(arch, expected):
    """FlashMLA's V4 decode serves SM90 / SM100; elsewhere no native reads the V4 cache and auto takes
    Triton. Each name resolves per kv_format: to the V4 kernels for V4 calls, the V3.2 ones otherwise."""
    natives = {name: caps.NativeStatus(name, True, version)
               for name, version in (("deep_gemm", "2.6.1"), ("flash_mla", "1.0.0"), ("flashinfer", "0.7.2"))}
    decision = router.decide("sparse_mla_decode", "auto", arch, FEATURES, natives=natives)
    assert decision.impl == expected, decision
    assert nb._dispatch.get_impl("sparse_mla_decode", "triton", V4).__module__.endswith(".sparse_mla_decode.v4")
    assert nb._dispatch.get_impl("sparse_mla_decode", "triton").__module__.endswith(".sparse_mla_decode")


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_misaligned_pages_stay_off_flash_mla(arch):
    """FlashMLA reads pages with TMA (16-byte units): a cache whose pages are not 16-byte aligned goes to
    Triton under auto and is refused by name; a call that does not report the alignment (``plan``, the
    frameworks' routes) is assumed aligned."""
    natives = {"flash_mla": caps.NativeStatus("flash_mla", True, "1.0.0")}
    assert router.decide("sparse_mla_decode", "auto", arch, {**FEATURES, "kv_cache_aligned": True},
                         natives=natives).impl == "flash_mla"
    odd = {**FEATURES, "kv_cache_aligned": False}
    assert router.decide("sparse_mla_decode", "auto", arch, odd, natives=natives).impl == "triton"
    with pytest.raises(ValueError, match=r"kv_cache_aligned=False is not True \(kv_cache and extra_kv_cache start "
                                         r"at 16-byte aligned addresses"):
        router.decide("sparse_mla_decode", "flash_mla", arch, odd, natives=natives)


@pytest.mark.parametrize(("pad", "extra_pad", "aligned"), [(0, 0, True), (40, 0, False), (584, 0, False),
                                                           (16, 0, True), (0, 8, False)])
def test_public_op_reports_page_alignment(monkeypatch, pad, extra_pad, aligned):
    """The public decode reports ``kv_cache_aligned`` from both caches' addresses and page strides."""
    seen = {}

    def resolve(op, impl, features):
        seen.update(features)
        return "reference"

    monkeypatch.setattr(nb.sparse_mla, "resolve_impl", resolve)
    gen = torch.Generator().manual_seed(0)
    main = _fuzz_cache(2, 64, gen, pad=pad, device="cpu")
    extra = _fuzz_cache(2, 64, gen, pad=extra_pad, device="cpu")
    q = torch.randn(1, 1, 2, 512).bfloat16()
    idx = torch.zeros(1, 1, 8, dtype=torch.int32)
    nb.sparse_mla_decode(q, main, idx, 0.05, kv_format=V4, extra_kv_cache=extra,
                         extra_indices=torch.zeros(1, 1, 4, dtype=torch.int32))
    assert seen["kv_cache_aligned"] is aligned


def test_native_decode_kernels_outside_their_v4_support_refuse():
    """FlashInfer reads no V4 cache; FlashMLA's V4 decode has no SM120 kernel."""
    natives = {"flash_mla": caps.NativeStatus("flash_mla", True, "1.0.0"),
               "flashinfer": caps.NativeStatus("flashinfer", True, "0.7.2")}
    for impl, arch in (("flash_mla", "sm120"), ("flashinfer", "sm120")):
        with pytest.raises(ValueError, match=f"impl={impl!r} is not usable on {arch}: "):
            router.decide("sparse_mla_decode", impl, arch, FEATURES, natives=natives)


# ----------------------------------------------------------------------------------------------
# GPU fuzz: the Triton kernel on the GPU against the reference on the CPU
# ----------------------------------------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("NSA_FUZZ_CASES", "300"))
# The GPU fuzz runs as shards of the cases, so pytest-xdist spreads them.
FUZZ_SHARDS = 6
FUZZ_TOPK = (1, 7, 64, 100, 128, 333, 512, 1000, 1024, 1152, 2048)
FUZZ_EXTRA_TOPK = (1, 64, 128, 129, 200)


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One seeded V4 decode call: shapes, page sizes, which optional inputs are given."""

    seed: int
    B: int
    s_q: int
    h_q: int
    topk: int
    page: int
    blocks: int
    invalid: float          # share of -1 entries in the index lists
    lengths: bool           # topk_length / extra_topk_length given
    sinks: bool
    extra_topk: int | None  # None: no second key list
    extra_page: int
    extra_blocks: int
    sm_scale: float

    def describe(self) -> str:
        return (f"seed={self.seed} B={self.B} s_q={self.s_q} h_q={self.h_q} topk={self.topk} page={self.page}x"
                f"{self.blocks} invalid={self.invalid} lengths={self.lengths} sinks={self.sinks} "
                f"extra={self.extra_topk} ({self.extra_page}x{self.extra_blocks})")


def fuzz_cases(n: int = FUZZ_CASES) -> list[FuzzCase]:
    """``n`` seeded cases: h_q 1..128 (the framework buckets and arbitrary counts), topk powers of two and
    not, page sizes 64 and 256 for both caches, extras on / off, -1 entries (none to all), lengths, sinks."""
    rng = random.Random(30)
    cases = []
    for seed in range(n):
        h_q = rng.choice((1, 2, 8, 16, 32, 64, 128)) if rng.random() < 0.5 else rng.randint(1, 128)
        page = rng.choice((64, 256))
        extra_page = rng.choice((64, 256))
        cases.append(FuzzCase(
            seed=seed, B=rng.randint(1, 4), s_q=rng.choice((1, 1, 2, 4)), h_q=h_q, topk=rng.choice(FUZZ_TOPK),
            page=page, blocks=rng.randint(1, 1024 // page), invalid=rng.choice((0.0, 0.1, 0.5, 1.0)),
            lengths=rng.random() < 0.7, sinks=rng.random() < 0.5,
            extra_topk=rng.choice(FUZZ_EXTRA_TOPK) if rng.random() < 0.6 else None, extra_page=extra_page,
            extra_blocks=rng.randint(1, 512 // extra_page), sm_scale=512 ** -0.5 * rng.uniform(0.5, 2.0)))
    return cases


def _fuzz_cache(blocks: int, page: int, gen: torch.Generator, pad: int, device: str) -> torch.Tensor:
    """Block-split V4 cache on ``device``, pages ``pad`` bytes apart beyond their size."""
    kv = (torch.randn(blocks * page, 512, generator=gen) * 2).bfloat16()
    rows = nb.pack_fp8_ds_mla_v4(kv, impl="reference").view(blocks, page, 584)
    buf = torch.full((blocks, page * 584 + pad), 0xFF, dtype=torch.uint8)
    buf[:, :page * 576] = rows[:, :, :576].reshape(blocks, -1)
    buf[:, page * 576:page * 584] = rows[:, :, 576:].reshape(blocks, -1)
    return buf.to(device)[:, :page * 584].view(blocks, page, 584)


def _fuzz_indices(c: FuzzCase, topk: int, n_slots: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, n_slots, (c.B, c.s_q, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(c.B, c.s_q, topk, generator=gen) < c.invalid] = -1
    return idx


def fuzz_inputs(c: FuzzCase, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``(q, kv_cache, indices, keyword arguments)`` of case ``c`` on ``device`` (same values on every device)."""
    gen = torch.Generator().manual_seed(c.seed)
    main = _fuzz_cache(c.blocks, c.page, gen, pad=rng_pad(c), device=device)
    q = torch.randn(c.B, c.s_q, c.h_q, 512, generator=gen).bfloat16()
    idx = _fuzz_indices(c, c.topk, c.blocks * c.page, gen)
    kw: dict = {"kv_format": V4}
    if c.lengths:
        kw["topk_length"] = torch.randint(0, c.topk + 1, (c.B,), generator=gen, dtype=torch.int32)
    if c.sinks:
        kw["attn_sink"] = torch.randn(c.h_q, generator=gen) * 2
    if c.extra_topk is not None:
        kw["extra_kv_cache"] = _fuzz_cache(c.extra_blocks, c.extra_page, gen, pad=0, device=device)
        kw["extra_indices"] = _fuzz_indices(c, c.extra_topk, c.extra_blocks * c.extra_page, gen)
        if c.lengths:
            kw["extra_topk_length"] = torch.randint(0, c.extra_topk + 1, (c.B,), generator=gen, dtype=torch.int32)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) and k != "extra_kv_cache" else v for k, v in kw.items()}
    return q.to(device), main, idx.to(device), kw


def rng_pad(c: FuzzCase) -> int:
    """Page padding of the main cache: none, or a stride that is not a multiple of 16 bytes."""
    return (0, 40, 584)[c.seed % 3]


def _fuzz_check(c: FuzzCase, device: str, impl: str = "triton") -> None:
    q, main, idx, kw = fuzz_inputs(c, device)
    out, lse = nb.sparse_mla_decode(q, main, idx, c.sm_scale, impl=impl, **kw)
    # The reference on the same tensors (plain torch, float32 / float64 on any device).
    want_out, want_lse = nb.sparse_mla_decode(q, main, idx, c.sm_scale, impl="reference", **kw)
    def say(m: str) -> str:
        return f"{c.describe()}\n{m}"

    torch.testing.assert_close(out.float(), want_out.float(), atol=1.6e-2, rtol=1.6e-2, msg=say)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4, msg=say)


def test_fuzz_cases_are_valid_inputs():
    """Every fuzz case passes the public op's checks (the call gets as far as routing, which refuses
    FlashMLA for CPU tensors), and the cases cover what the fuzz promises."""
    cases = fuzz_cases()
    assert len(cases) >= 300
    for c in cases:
        q, main, idx, kw = fuzz_inputs(c, "cpu")
        with pytest.raises(ValueError, match="impl='flash_mla' is not usable on cpu: flash_mla needs a GPU"):
            nb.sparse_mla_decode(q, main, idx, c.sm_scale, impl="flash_mla", **kw)
    heads = {c.h_q for c in cases}
    assert {1, 128} <= heads and len(heads) > 40
    assert {c.page for c in cases} == {64, 256} == {c.extra_page for c in cases if c.extra_topk}
    assert {c.topk for c in cases} == set(FUZZ_TOPK)
    for flags in ({c.extra_topk is None for c in cases}, {c.sinks for c in cases}, {c.lengths for c in cases}):
        assert flags == {True, False}
    assert {c.invalid for c in cases} == {0.0, 0.1, 0.5, 1.0}


def test_fuzz_case_runs_in_the_interpreter():
    """One small fuzz case (extras, lengths, sinks, 256-token pages) through the Triton kernel on CPU."""
    c = next(c for c in fuzz_cases() if c.h_q <= 16 and c.topk <= 128 and c.extra_topk is not None and c.lengths
             and c.sinks and 0 < c.invalid < 1 and 256 in (c.page, c.extra_page) and c.B * c.s_q <= 4)
    _fuzz_check(c, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_sparse_mla_v4_decode_gpu(shard):
    for c in fuzz_cases()[shard::FUZZ_SHARDS]:
        _fuzz_check(c, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_flash_mla_v4_decode_gpu(shard):
    """FlashMLA's DeepSeek-V4 decode through our native route (heads padded to 64 / 128, lists cut to their
    lengths) against the reference on the same fuzz cases, where the GPU and the installed package serve it."""
    pytest.importorskip("flash_mla")
    for c in fuzz_cases()[shard::FUZZ_SHARDS]:
        # pages FlashMLA's TMA cannot address are refused by name (auto takes Triton); a single page has
        # no page stride, so its padding does not matter
        if rng_pad(c) % 16 and c.blocks > 1:
            q, main, idx, kw = fuzz_inputs(c, "cuda")
            with pytest.raises(ValueError, match="kv_cache_aligned=False"):
                nb.sparse_mla_decode(q, main, idx, c.sm_scale, impl="flash_mla", **kw)
            continue
        _fuzz_check(c, "cuda", impl="flash_mla")
