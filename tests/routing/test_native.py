"""Argument translation of the native wrappers, checked on CPU against fake DeepGEMM / FlashMLA /
FlashInfer modules that record their arguments and compute with the plain-PyTorch reference."""

from __future__ import annotations

import inspect
import math
import sys
import types

import pytest
import torch

from nsa_backend import reference, routing
from nsa_backend.native import deep_gemm as dg_wrap
from nsa_backend.native import flash_mla as fm_wrap
from nsa_backend.native import flashinfer as fi_wrap
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import device as route_device
from nsa_backend.routing import router

FP8 = torch.float8_e4m3fn


@pytest.fixture
def on_arch(monkeypatch):
    """Make CPU tensors route as if they lived on ``arch`` (the wrappers ask routing for padding)."""
    def set_arch(arch: str):
        monkeypatch.setattr(route_device, "hardware_arch", lambda device: arch)
        router.padded_heads.cache_clear()
    return set_arch


def _install(monkeypatch, name: str, module: types.ModuleType, version: str | None):
    monkeypatch.setitem(sys.modules, name, module)
    status = {name: caps.NativeStatus(name, True, version)}
    routing.set_native_status(status)


# ----------------------------------------------------------------------------------------------
# DeepGEMM
# ----------------------------------------------------------------------------------------------

class FakeDeepGEMM(types.ModuleType):
    """A DeepGEMM module exposing what the release ``api`` exports; ``declared`` is its ``__version__``
    (upstream 2.2+ declares one, forks declare their own numbering, 2.0 - 2.1 none)."""

    def __init__(self, api: str, declared: str | None = "same"):
        super().__init__("deep_gemm")
        if declared == "same":
            declared = api if api >= "2.2" else None
        if declared is not None:
            self.__version__ = declared
        self.api = api
        self.calls: list[tuple[str, dict]] = []
        if api >= "2.3":
            self.tf32_hc_prenorm_gemm = self._tf32_hc_prenorm_gemm
        if api >= "2.4":
            self.fp8_fp4_paged_mqa_logits = self.fp8_paged_mqa_logits
        if api >= "2.6":
            self.bf16_mega_moe = object()

    def fp8_mqa_logits(self, q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0):
        self.calls.append(("fp8_mqa_logits", {"heads": q.shape[1], "weights": weights, "clean": clean_logits}))
        assert not (clean_logits and max_seqlen_k > 0), "DeepGEMM asserts this"
        return reference.fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits, max_seqlen_k)

    def get_paged_mqa_logits_metadata(self, context_lens, block_kv, num_sms):
        self.calls.append(("metadata", {"ndim": context_lens.dim(), "ctx": context_lens.clone()}))
        if self.api >= "2.4":
            assert context_lens.dim() == 2
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_paged_mqa_logits(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, clean_logits=False):
        self.calls.append(("paged", {"heads": q.shape[2], "ndim": context_lens.dim(), "clean": clean_logits,
                                     "ctx": context_lens.clone()}))
        if clean_logits:
            assert context_lens.dim() == 1, "DeepGEMM cleans only 1-D lengths"
        out = reference.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                             max_context_len, clean_logits)
        if not clean_logits:   # unclean entries are unspecified: poison them
            out = torch.nan_to_num(out, neginf=12345.0)
        return out

    def _tf32_hc_prenorm_gemm(self, a, b, d, sqr_sum, num_splits):
        self.calls.append(("hc", {"num_splits": num_splits}))
        reference.tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits)


def _indexer_inputs(s=5, n=40, h=16, d=64):
    q = torch.randn(s, h, d).to(FP8)
    k = torch.randn(n, d).to(FP8)
    k_scale = torch.rand(n) + 0.1
    weights = torch.randn(s, h)
    ks = torch.tensor([0, 3, 5, 10, 0][:s], dtype=torch.int32)
    ke = torch.tensor([7, 20, 30, 40, 40][:s], dtype=torch.int32)
    return q, (k, k_scale), weights, ks, ke


@pytest.mark.parametrize(("arch", "version", "padded"), [("sm90", "2.6.1", 32), ("sm100", "2.6.1", 16),
                                                         ("sm100", "2.3.0", 64)])
def test_deep_gemm_ragged_pads_heads_with_zero_weights(monkeypatch, on_arch, arch, version, padded):
    fake = FakeDeepGEMM(version)
    _install(monkeypatch, "deep_gemm", fake, version)
    dg_wrap._module.cache_clear()
    on_arch(arch)
    q, kv, w, ks, ke = _indexer_inputs(h=16)
    out = dg_wrap.fp8_mqa_logits(q, kv, w, ks, ke, True, 0)
    rec = fake.calls[-1][1]
    assert rec["heads"] == padded
    assert torch.count_nonzero(rec["weights"][:, 16:]) == 0
    assert torch.equal(out, reference.fp8_mqa_logits(q, kv, w, ks, ke, True, 0))


def test_deep_gemm_compressed_clean_is_masked_here(monkeypatch, on_arch):
    fake = FakeDeepGEMM("2.6.1")
    _install(monkeypatch, "deep_gemm", fake, "2.6.1")
    dg_wrap._module.cache_clear()
    on_arch("sm90")
    q, kv, w, ks, ke = _indexer_inputs(h=32)
    out = dg_wrap.fp8_mqa_logits(q, kv, w, ks, ke, True, 40)
    assert fake.calls[-1][1]["clean"] is False
    ref = reference.fp8_mqa_logits(q, kv, w, ks, ke, True, 40)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.allclose(out[~torch.isinf(ref)], ref[~torch.isinf(ref)])


def _paged_inputs(b=2, next_n=2, h=16, d=64, block_kv=64):
    ctx = torch.tensor([70, 9], dtype=torch.int32)[:b]
    keys = torch.randn(150, d)
    cache = reference.pack_indexer_k_cache(keys, block_kv)      # 3 pages
    block_table = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32)[:b]
    q = torch.randn(b, next_n, h, d).to(FP8)
    w = torch.randn(b * next_n, h)
    return q, cache, w, ctx, block_table


@pytest.mark.parametrize(("version", "declared"), [("2.6.1", "same"), ("2.3.0", "same"), ("2.6", "0.2.3.post2")],
                         ids=["2.6", "2.3", "sgl-deep-gemm"])
def test_deep_gemm_paged_1d_lengths(monkeypatch, on_arch, version, declared):
    fake = FakeDeepGEMM(version, declared)
    _install(monkeypatch, "deep_gemm", fake, version)
    dg_wrap._module.cache_clear()
    on_arch("sm90")
    q, cache, w, ctx, bt = _paged_inputs()
    meta = dg_wrap.get_paged_mqa_logits_metadata(ctx, 64, 8)
    out = dg_wrap.fp8_paged_mqa_logits(q, cache, w, ctx, bt, meta, 80, True)
    ref = reference.fp8_paged_mqa_logits(q, cache, w, ctx, bt, meta, 80, True)
    assert torch.equal(out, ref)
    paged = [rec for name, rec in fake.calls if name == "paged"][-1]
    assert paged["heads"] == 32
    if version >= "2.4":
        # 1-D lengths become exclusive per-row limits, the schedule is rebuilt for them, and the
        # -inf mask is written by the wrapper.
        assert paged["ndim"] == 2 and paged["clean"] is False
        assert paged["ctx"].tolist() == [[69, 70], [8, 9]]
        assert [rec["ndim"] for name, rec in fake.calls if name == "metadata"] == [2, 2]
    else:
        assert paged["ndim"] == 1 and paged["clean"] is True


def test_deep_gemm_paged_2d_lengths_on_1d_release(monkeypatch, on_arch):
    fake = FakeDeepGEMM("2.1")
    _install(monkeypatch, "deep_gemm", fake, None)
    dg_wrap._module.cache_clear()
    on_arch("sm90")
    q, cache, w, ctx, bt = _paged_inputs(next_n=1)
    ctx2 = ctx.view(-1, 1)
    meta = dg_wrap.get_paged_mqa_logits_metadata(ctx2, 64, 8)
    out = dg_wrap.fp8_paged_mqa_logits(q, cache, w, ctx2, bt, meta, 80, True)
    assert fake.calls[-1][1]["ndim"] == 1
    assert torch.equal(out, reference.fp8_paged_mqa_logits(q, cache, w, ctx2, bt, meta, 80, True))
    q2, cache, w2, _, _ = _paged_inputs(next_n=2)
    with pytest.raises(ValueError, match="next_n == 1"):
        dg_wrap.fp8_paged_mqa_logits(q2, cache, w2, torch.tensor([[5, 6], [7, 8]], dtype=torch.int32), bt,
                                     meta, 80, False)


def test_deep_gemm_api_version_of_forks():
    assert caps.deep_gemm_api_version(FakeDeepGEMM("2.6", "0.2.3.post2")) == "2.6"
    assert caps.deep_gemm_api_version(FakeDeepGEMM("2.4", "0.1.7")) == "2.4"
    assert caps.deep_gemm_api_version(FakeDeepGEMM("2.3.0")) == "2.3.0"
    assert caps.deep_gemm_api_version(FakeDeepGEMM("2.1")) == "2.1"
    status = caps.NativeStatus("deep_gemm", True, "0.2.3.post2", api_version="2.6")
    verdict = caps.evaluate("fp8_mqa_logits", "deep_gemm", "sm100", {"num_heads": 16, "head_dim": 128},
                            {"deep_gemm": status})
    assert verdict.ok and not verdict.padded


def test_deep_gemm_hc_prenorm_passes_num_splits_positionally(monkeypatch):
    fake = FakeDeepGEMM("2.6.1")
    _install(monkeypatch, "deep_gemm", fake, "2.6.1")
    dg_wrap._module.cache_clear()
    a = torch.randn(4, 128).to(torch.bfloat16)
    b = torch.randn(24, 128)
    d = torch.empty(2, 4, 24)
    s = torch.empty(2, 4)
    dg_wrap.tf32_hc_prenorm_gemm(a, b, d, s, 2)
    assert fake.calls[-1] == ("hc", {"num_splits": 2})
    assert torch.allclose(d.sum(0), a.float() @ b.T, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# DeepGEMM over an MXFP4 key cache (the 2.8 API: q / kv pairs, compressed uncleaned ragged output,
# 2-D context lengths, SM100 paged logits in the varlen form only)
# ----------------------------------------------------------------------------------------------

GARBAGE = 777.0   # what the fake leaves where DeepGEMM does not clean


class FakeDeepGEMMFp4(types.ModuleType):
    """DeepGEMM 2.8's ``fp8_fp4_*mqa_logits`` checking the argument types it asserts and computing with the
    reference; entries DeepGEMM leaves uncleaned are ``GARBAGE``."""

    __version__ = "2.8.1"

    def __init__(self, varlen: bool):
        super().__init__("deep_gemm")
        self.varlen = varlen
        self.calls: list[tuple[str, dict]] = []

    @staticmethod
    def _q(q):
        values, scales = q
        assert values.dtype == torch.int8 and scales.dtype == torch.int32
        assert scales.shape == values.shape[:-1] and values.shape[-1] == 64
        return values.view(torch.uint8), scales.contiguous().view(torch.uint8).view(*scales.shape, 4)

    def fp8_fp4_mqa_logits(self, q, kv, weights, ks, ke, max_seqlen_k, logits_dtype=torch.float32,
                           schedule_meta=None):
        assert max_seqlen_k > 0 and logits_dtype == torch.float32
        qv, qs = self._q(q)
        k, k_sf = kv
        assert k.dtype == torch.int8 and k_sf.dtype == torch.int32 and k_sf.shape == (k.shape[0],)
        self.calls.append(("ragged", {"heads": qv.shape[1], "max_seqlen_k": max_seqlen_k}))
        out = reference.fp8_fp4_mqa_logits(qv, qs, k.view(torch.uint8), k_sf.view(torch.uint8).view(-1, 4),
                                           weights, ks, ke, True, max_seqlen_k)
        return out.masked_fill(out == float("-inf"), GARBAGE)

    def get_paged_mqa_logits_metadata(self, context_lens, block_kv, num_sms, indices=None):
        assert context_lens.dim() == 2 and (indices is not None) == self.varlen
        self.calls.append(("metadata", {"num_sms": num_sms}))
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_fp4_paged_mqa_logits(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                 max_context_len, logits_dtype=torch.float32, indices=None):
        qv, qs = self._q(q)
        assert context_lens.dim() == 2 and context_lens.shape == qv.shape[:2]
        table = block_table
        if self.varlen:
            assert indices is not None and qv.shape[1] == 1 and indices.shape == (qv.shape[0],)
            table = block_table[indices.long()]
        else:
            assert indices is None
        self.calls.append(("paged", {"heads": qv.shape[2], "rows": qv.shape[0], "next_n": qv.shape[1]}))
        out = reference.fp8_fp4_paged_mqa_logits(qv, qs, kv_cache, weights, context_lens, table, None,
                                                 max_context_len, True)
        return out.masked_fill(out == float("-inf"), GARBAGE)


@pytest.fixture
def fake_fp4_deep_gemm(monkeypatch, on_arch):
    def install(arch: str) -> FakeDeepGEMMFp4:
        fake = FakeDeepGEMMFp4(varlen=arch == "sm100")
        _install(monkeypatch, "deep_gemm", fake, "2.8.1")
        dg_wrap._module.cache_clear()
        on_arch(arch)
        monkeypatch.setattr(dg_wrap, "_arch_major", lambda device: int(arch[2:-1]))
        return fake
    yield install
    dg_wrap._module.cache_clear()


def _mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_mxfp4(x)


@pytest.mark.parametrize(("arch", "heads", "padded"), [("sm100", 5, 8), ("sm100", 64, 64), ("sm120", 16, 32)])
@pytest.mark.parametrize("max_seqlen_k", [0, 12])
def test_deep_gemm_fp4_ragged_translation(fake_fp4_deep_gemm, arch, heads, padded, max_seqlen_k):
    """Full-width and compressed output, with the -inf mask, from DeepGEMM's compressed uncleaned rows."""
    fake = fake_fp4_deep_gemm(arch)
    gen = torch.Generator().manual_seed(0)
    s, n = 6, 30
    q, q_sf = _mxfp4(torch.randn(s, heads, 128, generator=gen))
    k, k_sf = _mxfp4(torch.randn(n, 128, generator=gen))
    w = torch.randn(s, heads, generator=gen)
    ks = torch.tensor([0, 0, 3, 5, 10, 29], dtype=torch.int32)
    ke = torch.tensor([1, 7, 9, 16, 22, 30], dtype=torch.int32)
    out = dg_wrap.fp8_fp4_mqa_logits(q, q_sf, k, k_sf, w, ks, ke, True, max_seqlen_k)
    ref = reference.fp8_fp4_mqa_logits(q, q_sf, k, k_sf, w, ks, ke, True, max_seqlen_k)
    assert out.shape == ref.shape and torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.allclose(out[~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-4)
    assert fake.calls[-1] == ("ragged", {"heads": padded, "max_seqlen_k": max_seqlen_k or n})


@pytest.mark.parametrize(("arch", "heads", "padded"), [("sm100", 5, 8), ("sm120", 16, 32)])
@pytest.mark.parametrize("lens_2d", [False, True])
def test_deep_gemm_fp4_paged_translation(fake_fp4_deep_gemm, arch, heads, padded, lens_2d):
    """SM100 gets one row per request with its request index (varlen), SM120 the 2-D lengths; the
    schedule is DeepGEMM's for what is sent; columns past each row's length are -inf."""
    fake = fake_fp4_deep_gemm(arch)
    gen = torch.Generator().manual_seed(1)
    b, next_n, block_kv, max_len = 3, 2, 32, 96
    cache = reference.pack_indexer_k_cache_fp4(torch.randn(b * max_len, 128, generator=gen), block_kv)
    table = torch.randperm(cache.shape[0], generator=gen).to(torch.int32).view(b, -1)
    q, q_sf = _mxfp4(torch.randn(b, next_n, heads, 128, generator=gen))
    w = torch.randn(b * next_n, heads, generator=gen)
    lens = torch.tensor([5, 64, 96], dtype=torch.int32)
    if lens_2d:
        lens = expand = dg_wrap.expand_context_lens(lens, next_n)
        assert expand.shape == (b, next_n)
    sched = torch.zeros(133, 2, dtype=torch.int32)
    out = dg_wrap.fp8_fp4_paged_mqa_logits(q, q_sf, cache, w, lens, table, sched, max_len, True)
    ref = reference.fp8_fp4_paged_mqa_logits(q, q_sf, cache, w, lens, table, None, max_len, True)
    assert out.shape == ref.shape and torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.allclose(out[~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-4)
    assert ("metadata", {"num_sms": 132}) in fake.calls
    varlen = arch == "sm100"
    assert fake.calls[-1] == ("paged", {"heads": padded, "rows": b * next_n if varlen else b,
                                        "next_n": 1 if varlen else next_n})


def test_deep_gemm_fp4_needs_mxfp4_queries(fake_fp4_deep_gemm):
    fake_fp4_deep_gemm("sm100")
    q = torch.zeros(2, 8, 128, dtype=FP8)
    k, k_sf = _mxfp4(torch.randn(4, 128))
    with pytest.raises(ValueError, match="q_scale"):
        dg_wrap.fp8_fp4_mqa_logits(q, None, k, k_sf, torch.ones(2, 8), torch.zeros(2, dtype=torch.int32),
                                   torch.full((2,), 4, dtype=torch.int32), True, 0)


# ----------------------------------------------------------------------------------------------
# FlashMLA
# ----------------------------------------------------------------------------------------------

def _make_flash_mla(with_legacy: bool) -> types.ModuleType:
    mod = types.ModuleType("flash_mla")
    mod.__version__ = "1.0.0"
    mod.calls = []

    def sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, **kw):
        mod.calls.append(("prefill", {"heads": q.shape[1], "topk": indices.shape[-1], **kw}))
        mod.sent_prefill_indices = indices.clone()
        return reference.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)

    def with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits=None,
                     softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                     topk_length=None, **kw):
        mod.calls.append(("decode", {"heads": q.shape[2], "cache_dim": k_cache.dim(), "fp8": is_fp8_kvcache,
                                     "indices": indices.clone(), "sched": sched, **kw}))
        assert any(sched is made for made in mod.schedules) and block_table is None and not causal
        return reference.sparse_mla_decode(q, k_cache, indices, softmax_scale, head_dim_v, "fp8_ds_mla",
                                           attn_sink, topk_length)

    if with_legacy:
        def sparse_fwd_legacy(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                              use_legacy=False, return_log2_lse=None):
            return sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=use_legacy)

        def with_kvcache_legacy(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits=None,
                                softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                                attn_sink=None, topk_length=None, use_legacy=False):
            return with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits,
                                softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                                use_legacy=use_legacy)
        mod.flash_mla_sparse_fwd, mod.flash_mla_with_kvcache = sparse_fwd_legacy, with_kvcache_legacy
    else:
        def sparse_fwd_upstream(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
            return sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)

        def with_kvcache_upstream(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits=None,
                                  softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                                  attn_sink=None, topk_length=None):
            return with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits,
                                softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length)
        mod.flash_mla_sparse_fwd, mod.flash_mla_with_kvcache = sparse_fwd_upstream, with_kvcache_upstream
    mod.schedules = []

    def get_mla_metadata(*args, **kwargs):
        mod.schedules.append(types.SimpleNamespace())  # a fresh, empty schedule object, as FlashMLA's
        return mod.schedules[-1], None

    mod.get_mla_metadata = get_mla_metadata
    return mod


@pytest.fixture
def flash_mla_module(monkeypatch):
    def install(with_legacy: bool):
        mod = _make_flash_mla(with_legacy)
        _install(monkeypatch, "flash_mla", mod, "1.0.0")
        fm_wrap._module.cache_clear()
        fm_wrap._accepts.cache_clear()
        fm_wrap.clear_decode_schedules()
        return mod
    yield install
    fm_wrap._module.cache_clear()
    fm_wrap._accepts.cache_clear()
    fm_wrap.clear_decode_schedules()


PREFILL_S_Q, PREFILL_S_KV, PREFILL_TOPK = 3, 50, 40


def _prefill_matches_reference(h: int, sink: torch.Tensor | None, topk_length: torch.Tensor | None) -> torch.Tensor:
    """Run the wrapper on a small prefill (indices from -1 to past ``kv``) against the reference; the indices."""
    q = torch.randn(PREFILL_S_Q, h, 576).to(torch.bfloat16)
    kv = torch.randn(PREFILL_S_KV, 1, 576).to(torch.bfloat16)
    idx = torch.randint(-1, PREFILL_S_KV + 5, (PREFILL_S_Q, 1, PREFILL_TOPK), dtype=torch.int32)
    out = fm_wrap.flash_mla_sparse_fwd(q, kv, idx, 0.05, 512, sink, topk_length)
    ref = reference.flash_mla_sparse_fwd(q, kv, idx, 0.05, 512, sink, topk_length)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5, equal_nan=True)
    return idx


@pytest.mark.parametrize("with_legacy", [True, False], ids=["sgl-flash-mla", "upstream"])
def test_flash_mla_prefill_translation(flash_mla_module, on_arch, with_legacy):
    mod = flash_mla_module(with_legacy)
    on_arch("sm90")
    _prefill_matches_reference(16, torch.randn(16), None)
    call = mod.calls[-1][1]
    assert call["heads"] == 64 and call["topk"] == 128
    assert call.get("use_legacy") is (True if with_legacy else None)


def test_flash_mla_prefill_topk_length_and_invalid_rows_become_minus_one(flash_mla_module, on_arch):
    """FlashMLA gets no top-k length: entries past it, rows outside ``kv`` and padding columns are -1."""
    mod = flash_mla_module(True)
    on_arch("sm90")
    tl = torch.tensor([40, 7, 0], dtype=torch.int32)
    idx = _prefill_matches_reference(64, None, tl)
    sent = mod.sent_prefill_indices
    keep = (idx >= 0) & (idx < PREFILL_S_KV) & (torch.arange(PREFILL_TOPK) < tl.view(-1, 1, 1))
    assert sent.shape == (PREFILL_S_Q, 1, 128)
    assert torch.equal(sent[..., :PREFILL_TOPK], torch.where(keep, idx, -1)) and (sent[..., PREFILL_TOPK:] == -1).all()


def test_flash_mla_prefill_current_kernels_for_v4_on_sm100(flash_mla_module, on_arch, monkeypatch):
    mod = flash_mla_module(True)
    on_arch("sm100")
    monkeypatch.setattr(fm_wrap, "_device_major", lambda device: 10)
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    kv = torch.randn(10, 1, 512).to(torch.bfloat16)
    idx = torch.zeros(2, 1, 128, dtype=torch.int32)
    fm_wrap.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, None, None)
    assert mod.calls[-1][1]["use_legacy"] is False   # current kernels: no use_legacy passed


def _ds_mla_cache(num_blocks=2, page=64, filled=100):
    kv = torch.randn(filled, 576).to(torch.bfloat16)
    cache = torch.zeros(num_blocks * page, 656, dtype=torch.uint8)
    cache[:filled] = reference.pack_fp8_ds_mla(kv, "arbitrary")
    return cache.view(num_blocks, page, 656)


@pytest.mark.parametrize(("shape", "dim", "target", "value", "dtype"), [
    ((2, 1, 16, 576), 2, 64, 0.0, torch.bfloat16),  # decode q: heads
    ((40, 16, 576), 1, 64, 0.0, torch.bfloat16),  # prefill q: heads
    ((16,), 0, 64, 0.0, torch.float32),  # attn_sink
    ((3, 1, 100), 2, 128, -1, torch.int32),  # prefill indices: top-k columns
])
def test_flash_mla_pad_dim(shape, dim, target, value, dtype):
    x = (torch.randn(shape) * 10).to(dtype)
    out = fm_wrap._pad_dim(x, dim, target, value)
    want_shape = list(shape)
    want_shape[dim] = target
    assert list(out.shape) == want_shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.narrow(dim, 0, shape[dim]), x)
    assert (out.narrow(dim, shape[dim], target - shape[dim]) == value).all()
    assert fm_wrap._pad_dim(x, dim, shape[dim]) is x


def test_flash_mla_decode_translation(flash_mla_module, on_arch):
    mod = flash_mla_module(True)
    on_arch("sm90")
    cache = _ds_mla_cache()
    b, s_q, h, topk = 2, 1, 16, 48
    q = torch.randn(b, s_q, h, 576).to(torch.bfloat16)
    idx = torch.randint(-3, 140, (b, s_q, topk), dtype=torch.int32)   # includes slots >= 128 (invalid)
    tl = torch.tensor([48, 20], dtype=torch.int32)
    out, lse = fm_wrap.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", None, tl)
    ref_out, ref_lse = reference.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", None, tl)
    assert torch.allclose(out.float(), ref_out.float(), atol=1e-2) and torch.allclose(lse, ref_lse, atol=1e-4)
    call = mod.calls[-1][1]
    assert call["heads"] == 64 and call["cache_dim"] == 4 and call["fp8"] is True and call["use_legacy"] is True
    sent = call["indices"]
    assert sent.shape[-1] == 64 and int(sent.max()) < 128 and int(sent.min()) == -1
    with pytest.raises(ValueError, match="fp8_ds_mla or fp8_ds_mla_v4 cache"):
        fm_wrap.sparse_mla_decode(q, cache, idx, 0.05, 512, "bf16", None, None)


def _v4_cache(num_blocks: int, page: int, gen: torch.Generator) -> torch.Tensor:
    cache = torch.zeros(num_blocks, page, 584, dtype=torch.uint8)
    kv = torch.randn(num_blocks * page, 512, generator=gen).to(torch.bfloat16)
    reference.write_fp8_ds_mla_v4_cache(kv, cache, torch.arange(num_blocks * page, dtype=torch.int32))
    return cache


def _make_flash_mla_v4(legacy: bool = False) -> types.ModuleType:
    """FlashMLA's ``flash_mla_with_kvcache`` with the DeepSeek-V4 arguments, as vLLM 0.34 bundles it, or
    (``legacy``) as sgl-flash-mla ships it: ``use_legacy`` / ``kv_format``, its current kernels V4.1's only."""
    mod = types.ModuleType("flash_mla")
    mod.__version__ = "1.0.0"
    mod.calls = []

    def upstream(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                 num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                 indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                 topk_length=None, extra_topk_length=None, out=None, enable_batch_invariant=False):
        return run(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal,
                   is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                   extra_topk_length, {})

    def sgl(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
            softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None, extra_k_cache=None,
            extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None, enable_batch_invariant=False,
            use_legacy=False, kv_format=None, descale_q=None, descale_k=None):
        assert use_legacy, "sgl-flash-mla's current kernels read V4.1's 528-byte rows only"
        return run(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal,
                   is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                   extra_topk_length, {"use_legacy": use_legacy, "kv_format": kv_format})

    def run(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal,
            is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
            extra_topk_length, flags):
        assert block_table is None and cache_seqlens is None and num_splits is None and not causal
        assert is_fp8_kvcache and k_cache.dim() == 4 and k_cache.shape[-1] == 584
        mod.calls.append({"heads": q.shape[2], "indices": indices.clone(), "topk_length": topk_length, **flags,
                          "extra_cache": extra_k_cache, "extra_topk_length": extra_topk_length,
                          "extra_indices": None if extra_indices_in_kvcache is None
                          else extra_indices_in_kvcache.clone()})
        return reference.sparse_mla_decode(q, k_cache, indices, softmax_scale, head_dim_v, "fp8_ds_mla_v4",
                                           attn_sink, topk_length, None, extra_k_cache, extra_indices_in_kvcache,
                                           extra_topk_length)

    mod.flash_mla_with_kvcache = sgl if legacy else upstream
    mod.get_mla_metadata = lambda *args, **kwargs: (types.SimpleNamespace(), None)
    return mod


@pytest.mark.parametrize(("extra", "legacy"), [(False, False), (True, False), (True, True)])
def test_flash_mla_v4_decode_translation(monkeypatch, on_arch, extra, legacy):
    """The V4 decode reaches FlashMLA with the extra cache and list, heads padded to 64, both lists cut to
    their lengths and bounds as -1 in blocks of 64, and matches the reference on the real heads. In
    sgl-flash-mla it takes the legacy kernels with the format named."""
    mod = _make_flash_mla_v4(legacy)
    _install(monkeypatch, "flash_mla", mod, "1.0.0")
    fm_wrap._module.cache_clear()
    fm_wrap._accepts.cache_clear()
    fm_wrap.clear_decode_schedules()
    on_arch("sm90")
    gen = torch.Generator().manual_seed(3)
    cache, extra_cache = _v4_cache(2, 64, gen), _v4_cache(1, 256, gen)
    b, s_q, h = 2, 1, 8
    q = torch.randn(b, s_q, h, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(-2, 140, (b, s_q, 40), generator=gen, dtype=torch.int32)   # slots >= 128 are invalid
    tl = torch.tensor([40, 17], dtype=torch.int32)
    sink = torch.randn(h, generator=gen)
    ex = dict(extra_kv_cache=None, extra_indices=None, extra_topk_length=None)
    if extra:
        ex = dict(extra_kv_cache=extra_cache,
                  extra_indices=torch.randint(-1, 300, (b, s_q, 70), generator=gen, dtype=torch.int32),
                  extra_topk_length=torch.tensor([9, 70], dtype=torch.int32))
    args = (q, cache, idx, 0.04, 512, "fp8_ds_mla_v4", sink, tl, None, *ex.values())
    out, lse = fm_wrap.sparse_mla_decode(*args)
    ref_out, ref_lse = reference.sparse_mla_decode(*args)
    assert torch.allclose(out.float(), ref_out.float(), atol=1e-2) and torch.allclose(lse, ref_lse, atol=1e-4)
    call = mod.calls[-1]
    assert call["heads"] == 64 and call["topk_length"] is None and call["extra_topk_length"] is None
    assert (call.get("use_legacy"), call.get("kv_format")) == ((True, "V4") if legacy else (None, None))
    assert call["indices"].shape[-1] == 64 and int(call["indices"].max()) < 128
    assert (call["indices"][1, 0, 17:] == -1).all()
    if extra:
        assert call["extra_cache"].shape == (1, 256, 1, 584)
        sent = call["extra_indices"]
        assert sent.shape[-1] == 128 and int(sent.max()) < 256 and (sent[0, 0, 9:] == -1).all()
    else:
        assert call["extra_cache"] is None and call["extra_indices"] is None
    fm_wrap._module.cache_clear()
    fm_wrap._accepts.cache_clear()
    fm_wrap.clear_decode_schedules()


def test_flash_mla_decode_keeps_one_schedule_per_shape(flash_mla_module, on_arch, monkeypatch):
    """FlashMLA computes its split-KV schedule on the first call of a schedule object: calls of one
    shape share one object (whatever the index values and top-k lengths), other shapes get their own,
    and the least recently used is dropped beyond ``SCHEDULE_CACHE_SIZE``."""
    mod = flash_mla_module(True)
    on_arch("sm90")
    monkeypatch.setattr(fm_wrap, "SCHEDULE_CACHE_SIZE", 2)
    cache = _ds_mla_cache()

    def call(b, topk, seed, tl=None):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(b, 1, 64, 576, generator=g).to(torch.bfloat16)
        idx = torch.randint(-1, 128, (b, 1, topk), generator=g, dtype=torch.int32)
        fm_wrap.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", None, tl)
        return mod.calls[-1][1]["sched"]

    first = call(2, 64, 0)
    assert call(2, 64, 1, torch.tensor([10, 64], dtype=torch.int32)) is first
    assert call(2, 50, 2) is first                 # the same padded width (64)
    other = call(3, 64, 3)
    wider = call(2, 128, 4)
    assert other is not first and wider is not first and wider is not other
    assert len(mod.schedules) == 3
    assert call(2, 64, 5) is not first             # dropped: two shapes kept, (2, 64) the oldest


# ----------------------------------------------------------------------------------------------
# FlashInfer
# ----------------------------------------------------------------------------------------------

def _make_flashinfer(natural_lse: bool) -> types.ModuleType:
    mla = types.ModuleType("flashinfer.mla")
    mla.calls = []

    def decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
               block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0,
               bmm2_scale=1.0, sinks=None, return_lse=False, kv_scale_format="auto", **kw):
        mla.calls.append({"heads": query.shape[2], "kv_scale_format": kv_scale_format, "cache_dim": kv_cache.dim(),
                          "seq_lens": seq_lens, "topk": sparse_mla_top_k, "block_tables": block_tables, **kw})
        assert bmm2_scale == 1.0 and return_lse and kv_lora_rank == 512 and qk_rope_head_dim == 64
        b, s_q, h, _ = query.shape
        tl = seq_lens[:, 0] if seq_lens is not None else None
        o, lse = reference.sparse_mla_decode(query, kv_cache, block_tables, bmm1_scale, 512, "fp8_ds_mla",
                                             sinks[0] if sinks else None, tl)
        lse = lse.permute(0, 2, 1).reshape(b * s_q, h)
        if kw.get("return_lse_base") != "basee":
            lse = lse / math.log(2.0)
        return o.reshape(b * s_q, h, 512), lse

    if natural_lse:
        mla.trtllm_batch_decode_with_kv_cache_mla = decode
    else:
        def decode_old(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                       block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0,
                       bmm2_scale=1.0, sinks=None, return_lse=False, kv_scale_format="auto"):
            return decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                          block_tables, seq_lens, max_seq_len, sparse_mla_top_k, out, bmm1_scale, bmm2_scale,
                          sinks, return_lse, kv_scale_format)
        mla.trtllm_batch_decode_with_kv_cache_mla = decode_old
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.2"
    pkg.mla = mla
    return pkg


@pytest.mark.parametrize("natural_lse", [True, False], ids=["return_lse_base", "base2-release"])
def test_flashinfer_decode_translation(monkeypatch, on_arch, natural_lse):
    pkg = _make_flashinfer(natural_lse)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", pkg.mla)
    routing.set_native_status({"flashinfer": caps.NativeStatus("flashinfer", True, "0.7.2")})
    fi_wrap._decode_fn.cache_clear()
    fi_wrap._accepts.cache_clear()
    on_arch("sm120")
    monkeypatch.setattr(fi_wrap, "_workspace", lambda device: torch.zeros(16, dtype=torch.uint8))
    cache = _ds_mla_cache()
    b, s_q, h, topk = 2, 2, 12, 128
    q = torch.randn(b, s_q, h, 576).to(torch.bfloat16)
    idx = torch.randint(0, 100, (b, s_q, topk), dtype=torch.int32)
    idx[1, 1] = -1                      # a row with no valid index: out 0, lse +inf
    idx[0, 0, :5] = 500                 # out of the cache: invalid
    sink = torch.randn(h)
    tl = torch.tensor([128, 100], dtype=torch.int32)
    out, lse = fi_wrap.sparse_mla_decode(q, cache.unsqueeze(2), idx, 0.05, 512, "fp8_ds_mla", sink, tl)
    ref_out, ref_lse = reference.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", sink, tl)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.allclose(out.float(), ref_out.float(), atol=1e-2)
    assert torch.allclose(lse, ref_lse, atol=1e-4)
    assert torch.isinf(lse[1, :, 1]).all() and out[1, 1].abs().max() == 0
    call = pkg.mla.calls[-1]
    assert call["heads"] == 16 and call["cache_dim"] == 3 and call["topk"] == topk
    assert call["kv_scale_format"] == "arbitrary_fp32"
    assert call["seq_lens"].shape == (b, s_q)
    assert int(call["block_tables"][0, 0, :5].max()) == -1
    fi_wrap.set_kv_scale_format("pow2")
    try:
        fi_wrap.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", None, None)
        assert pkg.mla.calls[-1]["kv_scale_format"] == "pow2_fp32"
    finally:
        fi_wrap.set_kv_scale_format("arbitrary")
    # a per-call format (the public op's kv_scale_format) wins over the process setting
    fi_wrap.sparse_mla_decode(q, cache, idx, 0.05, 512, "fp8_ds_mla", None, None, "pow2")
    assert pkg.mla.calls[-1]["kv_scale_format"] == "pow2_fp32"
    with pytest.raises(ValueError, match="scale_format"):
        fi_wrap.set_kv_scale_format("ue8m0")


def test_wrappers_take_the_public_signatures():
    import nsa_backend as nb

    pairs = [(dg_wrap.fp8_mqa_logits, nb.fp8_mqa_logits), (dg_wrap.fp8_paged_mqa_logits, nb.fp8_paged_mqa_logits),
             (dg_wrap.get_paged_mqa_logits_metadata, nb.get_paged_mqa_logits_metadata),
             (dg_wrap.tf32_hc_prenorm_gemm, nb.tf32_hc_prenorm_gemm),
             (fm_wrap.flash_mla_sparse_fwd, nb.flash_mla_sparse_fwd), (fm_wrap.sparse_mla_decode, nb.sparse_mla_decode),
             (fi_wrap.sparse_mla_decode, nb.sparse_mla_decode)]
    for native, public in pairs:
        want = [p for p in inspect.signature(public).parameters if p != "impl"]
        assert list(inspect.signature(native).parameters) == want, native.__qualname__
    # The MXFP4 indexer ops call their implementations with split (values, scales) arguments: the
    # wrappers take the reference implementation's parameters.
    for native, ref in ((dg_wrap.fp8_fp4_mqa_logits, reference.fp8_fp4_mqa_logits),
                        (dg_wrap.fp8_fp4_paged_mqa_logits, reference.fp8_fp4_paged_mqa_logits)):
        assert list(inspect.signature(native).parameters) == list(inspect.signature(ref).parameters)


# ----------------------------------------------------------------------------------------------
# Against the real packages' Python signatures (where they import, e.g. scripts/sglang-env.sh)
# ----------------------------------------------------------------------------------------------

def test_calls_bind_to_real_flashinfer_signature(monkeypatch, on_arch):
    mla = pytest.importorskip("flashinfer.mla")
    real = inspect.signature(mla.trtllm_batch_decode_with_kv_cache_mla)
    seen = {}

    def checked(**kwargs):
        seen.update(real.bind(**kwargs).arguments)
        b, s_q, h, _ = kwargs["query"].shape
        return torch.zeros(b * s_q, h, 512, dtype=torch.bfloat16), torch.zeros(b * s_q, h)

    fi_wrap._accepts.cache_clear()
    monkeypatch.setattr(fi_wrap, "_decode_fn", lambda: checked)
    monkeypatch.setattr(fi_wrap, "_accepts", lambda p: p in real.parameters)
    monkeypatch.setattr(fi_wrap, "_workspace", lambda device: torch.zeros(16, dtype=torch.uint8))
    routing.set_native_status({"flashinfer": caps.NativeStatus("flashinfer", True, "0.7.2")})
    on_arch("sm120")
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    fi_wrap.sparse_mla_decode(q, _ds_mla_cache(), torch.zeros(1, 1, 128, dtype=torch.int32), 0.1, 512,
                              "fp8_ds_mla", torch.zeros(16), torch.tensor([5], dtype=torch.int32))
    assert seen["sparse_mla_top_k"] == 128 and seen["kv_scale_format"] == "arbitrary_fp32"
    assert seen["return_lse_base"] == "basee"


def test_calls_bind_to_real_deep_gemm_signatures(monkeypatch, on_arch):
    dg = pytest.importorskip("deep_gemm")
    names = ("fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "tf32_hc_prenorm_gemm")
    try:
        sigs = {name: inspect.signature(getattr(dg, name)) for name in names}
    except (TypeError, ValueError):
        pytest.skip("this DeepGEMM exposes C functions without Python signatures")
    calls = {}

    class Checked(types.ModuleType):
        def __getattr__(self, name):
            def call(*args):
                calls[name] = sigs[name].bind(*args).arguments
                if name == "get_paged_mqa_logits_metadata":
                    return torch.zeros(args[2] + 1, 2, dtype=torch.int32)
                if name == "fp8_paged_mqa_logits":
                    return torch.zeros(args[0].shape[0] * args[0].shape[1], args[6])
                if name == "fp8_mqa_logits":
                    return torch.zeros(args[0].shape[0], args[6] or args[1][0].shape[0])
                return None
            return call

    module = Checked("deep_gemm")
    module.__version__ = caps.deep_gemm_api_version(dg)
    monkeypatch.setattr(dg_wrap, "_module", lambda: module)
    routing.set_native_status({"deep_gemm": caps.NativeStatus("deep_gemm", True, module.__version__)})
    on_arch("sm90")
    q, kv, w, ks, ke = _indexer_inputs(h=32)
    dg_wrap.fp8_mqa_logits(q, kv, w, ks, ke, True, 0)
    qp, cache, wp, ctx, bt = _paged_inputs()
    meta = dg_wrap.get_paged_mqa_logits_metadata(ctx, 64, 8)
    dg_wrap.fp8_paged_mqa_logits(qp, cache, wp, ctx, bt, meta, 80, True)
    dg_wrap.tf32_hc_prenorm_gemm(torch.zeros(2, 64), torch.zeros(8, 64), torch.zeros(2, 8), torch.zeros(2), None)
    assert set(calls) == set(names)
