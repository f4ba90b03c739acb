"""The declarative capability table: its shape, its constraints and what it says per arch."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.routing import capabilities as caps
from nsa_backend.routing.capabilities import MultipleOf, NativeStatus, OneOf, Range, evaluate
from nsa_backend.routing.device import ARCH_FAMILIES

from .conftest import ALL_NATIVES


def _dg(version: str) -> dict[str, NativeStatus]:
    return {**ALL_NATIVES, "deep_gemm": NativeStatus("deep_gemm", True, version)}


def test_table_is_well_formed():
    for row in caps.TABLE:
        assert row.op in caps.OPS, row
        assert row.impl in caps.IMPLS, row
        assert row.archs and row.archs <= set(ARCH_FAMILIES) - {"cpu"}, row
        assert (row.package is not None) == (row.impl in caps.NATIVE_IMPLS), row
        for name, constraint in row.where:
            assert isinstance(name, str) and isinstance(constraint, (OneOf, Range, MultipleOf)), row


def test_triton_rows_cover_every_gpu():
    for op in caps.OPS:
        for row in caps.rows(op, "triton"):
            assert row.archs == set(ARCH_FAMILIES) - {"cpu"}
            assert row.where == ()


def test_constraints():
    heads = OneOf((32, 64), pad=True)
    assert heads.check(16) and heads.pad_to(16) == 32 and heads.pad_to(33) == 64 and heads.pad_to(64) == 64
    assert not heads.check(128) and heads.pad_to(128) is None
    assert not OneOf((576,)).check(512)
    assert Range(1, 64).check(64) and not Range(1, 64).check(65) and not Range(1, 64).check("x")
    assert MultipleOf(64).check(128) and not MultipleOf(64).check(96) and not MultipleOf(64).check(0)
    assert "zero-padded" in heads.describe()


def test_parse_version():
    assert caps.parse_version("0.6.18.post1+cu130") == (0, 6, 18)
    assert caps.parse_version("2.3.0") < caps.parse_version("2.4")
    assert caps.parse_version("garbage") == (0,)


IDX = {"head_dim": 128, "compressed": False}


@pytest.mark.parametrize(("version", "heads", "padded"), [("2.1", 16, 32), ("2.3.0", 32, 64), ("2.5.0", 16, 32),
                                                        ("2.6.1", 16, 16)])
def test_deep_gemm_sm100_head_bands(version, heads, padded):
    verdict = evaluate("fp8_mqa_logits", "deep_gemm", "sm100", {"num_heads": heads, **IDX}, _dg(version))
    assert verdict.ok and dict(verdict.padded).get("num_heads", heads) == padded


@pytest.mark.parametrize(("arch", "heads", "ok", "padded"), [
    ("sm90", 64, True, {}),
    ("sm90", 32, True, {}),
    ("sm90", 16, True, {"num_heads": 32}),        # zero-padded, zero weights
    ("sm90", 128, False, {}),
    ("sm100", 8, True, {}),
    ("sm100", 32, True, {}),
    ("sm103", 16, True, {}),
    ("sm100", 128, False, {}),
    ("sm120", 32, False, {}),
    ("sm89", 64, False, {}),
])
def test_deep_gemm_indexer_heads(arch, heads, ok, padded):
    verdict = evaluate("fp8_mqa_logits", "deep_gemm", arch, {"num_heads": heads, **IDX}, ALL_NATIVES)
    assert verdict.ok == ok, verdict.reason
    assert dict(verdict.padded) == padded


def test_deep_gemm_sm100_release_with_h52_bug_pads_to_64():
    verdict = evaluate("fp8_mqa_logits", "deep_gemm", "sm100", {"num_heads": 32, **IDX}, _dg("2.3.0"))
    assert verdict.ok and dict(verdict.padded) == {"num_heads": 64}
    assert "52" in verdict.reason


def test_deep_gemm_rejections_say_why():
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm89", {"num_heads": 32, **IDX}, ALL_NATIVES)
    assert "no fp8_mqa_logits kernel for sm89" in v.reason and "sm90" in v.reason
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 32, **IDX}, ALL_NATIVES)
    assert not v.ok and "only known on the GPU" in v.reason
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm90", {"num_heads": 128, **IDX}, ALL_NATIVES)
    assert "num_heads=128" in v.reason and "{32, 64}" in v.reason
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm90", {"num_heads": 64, **IDX}, {})
    assert "package deep_gemm is not importable" in v.reason
    v = evaluate("tf32_hc_prenorm_gemm", "deep_gemm", "sm90", {"n": 24, "k": 16384}, _dg("2.2.0"))
    assert not v.ok and "2.2.0" in v.reason and ">= 2.3" in v.reason
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm90", {"num_heads": 64}, ALL_NATIVES)
    assert "head_dim unknown" in v.reason


@pytest.mark.parametrize(("version", "next_n", "ctx_2d", "ok"), [
    ("2.6.1", 1, True, True),
    ("2.6.1", 4, True, True),
    ("2.6.1", 3, False, True),     # 1-D lengths are expanded to 2-D
    ("2.3.0", 2, True, True),
    ("2.3.0", 3, True, False),     # next_n <= 2 before 2.4
    ("2.1.0", 2, False, True),
    ("2.1.0", 1, True, True),      # 2-D with next_n == 1 is squeezed
    ("2.1.0", 2, True, False),     # 2-D lengths unsupported before 2.2
])
def test_deep_gemm_paged_forms(version, next_n, ctx_2d, ok):
    features = {"num_heads": 64, "head_dim": 128, "next_n": next_n, "page_size": 64, "context_lens_2d": ctx_2d}
    assert evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm90", features, _dg(version)).ok == ok


def test_deep_gemm_paged_page_size():
    ok = {"num_heads": 64, "head_dim": 128, "next_n": 1, "context_lens_2d": True}
    assert evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm100", {**ok, "page_size": 32}, ALL_NATIVES).ok
    assert not evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm90", {**ok, "page_size": 32}, ALL_NATIVES).ok
    assert evaluate("get_paged_mqa_logits_metadata", "deep_gemm", "sm100", {"page_size": 32}, ALL_NATIVES).ok
    assert not evaluate("get_paged_mqa_logits_metadata", "deep_gemm", "sm100", {"page_size": 32}, _dg("2.3")).ok


@pytest.mark.parametrize(("arch", "n", "ok"), [("sm90", 24, True), ("sm90", 40, False), ("sm100", 40, True),
                                               ("sm120", 24, False)])
def test_deep_gemm_hc_prenorm(arch, n, ok):
    assert evaluate("tf32_hc_prenorm_gemm", "deep_gemm", arch, {"n": n, "k": 16384}, ALL_NATIVES).ok == ok


@pytest.mark.parametrize(("arch", "heads", "d_qk", "ok", "padded"), [
    ("sm90", 128, 576, True, {}),
    ("sm90", 16, 576, True, {"num_heads": 64}),   # what frameworks do under TP=8
    ("sm100", 64, 512, True, {}),                 # DeepSeek-V4
    ("sm103", 32, 576, True, {"num_heads": 64}),
    ("sm120", 64, 576, False, {}),                # no SM120 kernels
    ("sm86", 64, 576, False, {}),
    ("sm90", 256, 576, False, {}),
])
def test_flash_mla_prefill(arch, heads, d_qk, ok, padded):
    verdict = evaluate("flash_mla_sparse_fwd", "flash_mla", arch, {"num_heads": heads, "d_qk": d_qk, "topk": 2048},
                       ALL_NATIVES)
    assert verdict.ok == ok, verdict.reason
    assert dict(verdict.padded) == padded


DECODE = {"num_heads": 16, "d_qk": 576, "topk": 2048, "s_q": 1, "kv_format": "fp8_ds_mla", "page_size": 64}


@pytest.mark.parametrize(("impl", "arch", "change", "ok"), [
    ("flash_mla", "sm90", {}, True),
    ("flash_mla", "sm100", {}, True),
    ("flash_mla", "sm90", {"kv_format": "bf16"}, False),
    ("flash_mla", "sm120", {}, False),
    ("flashinfer", "sm120", {}, True),
    ("flashinfer", "sm121", {"num_heads": 64, "topk": 512}, True),
    ("flashinfer", "sm120", {"num_heads": 12}, True),         # padded to the 16-head bucket
    ("flashinfer", "sm120", {"topk": 256}, False),            # not a (heads, topk) bucket
    ("flashinfer", "sm120", {"s_q": 65}, False),              # decode-sized calls only
    ("flashinfer", "sm120", {"page_size": 32}, False),
    ("flashinfer", "sm120", {"kv_format": "bf16"}, False),
    ("flashinfer", "sm90", {}, False),
])
def test_sparse_decode_natives(impl, arch, change, ok):
    assert evaluate("sparse_mla_decode", impl, arch, {**DECODE, **change}, ALL_NATIVES).ok == ok


def test_flashinfer_version_floor():
    old = {**ALL_NATIVES, "flashinfer": NativeStatus("flashinfer", True, "0.6.17")}
    verdict = evaluate("sparse_mla_decode", "flashinfer", "sm120", DECODE, old)
    assert not verdict.ok and "0.6.17" in verdict.reason


def test_reference_always_ok_and_unknown_impl():
    assert evaluate("sparse_mla_decode", "reference", "cpu", {}).ok
    assert not evaluate("topk_indices", "deep_gemm", "sm90", {}, ALL_NATIVES).ok


def test_shape_features_are_the_constrained_ones():
    assert caps.SHAPE_FEATURES["topk_indices"] == ()
    assert set(caps.SHAPE_FEATURES["fp8_mqa_logits"]) == {"num_heads", "head_dim"}
    assert "s_q" in caps.SHAPE_FEATURES["sparse_mla_decode"]


def test_probe_natives_reports_every_package():
    status = caps.probe_natives()
    assert set(status) == set(caps.NATIVE_IMPLS)
    for name, s in status.items():
        assert s.name == name and isinstance(s.available, bool)
        if not s.available:
            assert s.error


def test_describe_rows():
    rows = caps.describe_rows("sparse_mla_decode")
    assert {r["impl"] for r in rows} == {"triton", "flash_mla", "flashinfer"}
    assert any("sm120" in r["archs"] and r["impl"] == "flashinfer" for r in rows)


@pytest.mark.parametrize(("result", "ok"), [((False, "RuntimeError: Unsupported architecture"), False),
                                            ((True, ""), True)], ids=["upstream-build", "build-with-sm120"])
def test_deep_gemm_sm120_only_where_the_build_has_it(monkeypatch, result, ok):
    from nsa_backend.native import deep_gemm as dg_wrap
    from nsa_backend.routing import router

    calls = []
    monkeypatch.setattr(dg_wrap, "arch_supported", lambda device: calls.append(device) or result)
    monkeypatch.setattr(router, "hardware_arch", lambda device: "sm120")
    caps._probe_cache.clear()
    cuda = torch.device("cuda", 0)
    for _ in range(2):
        v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 32, **IDX, "device": cuda}, ALL_NATIVES)
        assert v.ok == ok, v.reason
    assert len(calls) == 1          # probed once per GPU
    if not ok:
        assert "has no sm120 kernels (RuntimeError: Unsupported architecture)" in v.reason
    # A forced sm120 route on other hardware cannot tell.
    monkeypatch.setattr(router, "hardware_arch", lambda device: "sm90")
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 32, **IDX, "device": cuda}, ALL_NATIVES)
    assert not v.ok and "can only be checked on an sm120 GPU" in v.reason
    caps._probe_cache.clear()
