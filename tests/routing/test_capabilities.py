"""The declarative capability table: its shape, its constraints and what it says per arch."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import device as route_device
from nsa_backend.routing.capabilities import Flag, MultipleOf, NativeStatus, OneOf, Range, evaluate
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
            assert isinstance(name, str) and isinstance(constraint, (OneOf, Range, MultipleOf, Flag)), row


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
    flag = Flag("pages 16-byte aligned")
    assert flag.check(True) and not flag.check(False) and not flag.check(1)
    assert flag.describe() == "True (pages 16-byte aligned)"


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
    assert not v.ok and "sm120_fp8_mqa_logits is unknown: its library was not read" in v.reason
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

    calls = []
    monkeypatch.setattr(dg_wrap, "arch_supported", lambda device: calls.append(device) or result)
    monkeypatch.setattr(route_device, "hardware_arch", lambda device: "sm120")
    caps._probe_cache.clear()
    cuda = torch.device("cuda", 0)
    for _ in range(2):
        v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 32, **IDX, "device": cuda}, ALL_NATIVES)
        assert v.ok == ok, v.reason
    assert len(calls) == 1          # probed once per GPU
    if not ok:
        assert "has no sm120 kernels (RuntimeError: Unsupported architecture)" in v.reason
    # A forced sm120 route on other hardware cannot tell.
    monkeypatch.setattr(route_device, "hardware_arch", lambda device: "sm90")
    v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 32, **IDX, "device": cuda}, ALL_NATIVES)
    assert not v.ok and "can only be checked on an sm120 GPU" in v.reason
    caps._probe_cache.clear()


# ----------------------------------------------------------------------------------------------
# SM120 / SM121: rows gated by what the installed DeepGEMM library contains
# ----------------------------------------------------------------------------------------------

SM120_KERNELS = frozenset({"sm120_fp8_mqa_logits", "sm120_paged_mqa_logits_metadata", "sm120_fp8_paged_mqa_logits",
                           "sm120_tf32_hc_prenorm_gemm", "sm90_fp8_mqa_logits", "sm100_mqa_logits"})


def _dg_lib(kernels=SM120_KERNELS, limits=None, version="2.8.1") -> dict[str, NativeStatus]:
    library = caps.LibraryInfo("/x/_C.so", frozenset(kernels), dict(limits or {}))
    return {**ALL_NATIVES, "deep_gemm": NativeStatus("deep_gemm", True, version, library=library)}


PAGED = {"head_dim": 128, "next_n": 1, "context_lens_2d": True}


@pytest.mark.parametrize(("arch", "heads", "ok", "padded"), [
    ("sm120", 16, True, {"num_heads": 32}),       # nsa-backend's own deep_gemm route pads with zero heads
    ("sm120", 32, True, {}),
    ("sm121", 64, True, {}),
    ("sm120", 128, False, {}),
])
def test_deep_gemm_sm120_heads_from_library(arch, heads, ok, padded):
    for op, extra in (("fp8_mqa_logits", {}), ("fp8_paged_mqa_logits", {**PAGED, "page_size": 64})):
        verdict = evaluate(op, "deep_gemm", arch, {"num_heads": heads, "head_dim": 128, **extra}, _dg_lib())
        assert verdict.ok == ok, verdict.reason
        assert dict(verdict.padded) == padded
        if ok:
            assert "sm120_" in verdict.reason and "_C.so" in verdict.reason


def test_deep_gemm_sm120_missing_kernel_and_library_limits_say_why():
    features = {"num_heads": 64, **PAGED, "page_size": 64}
    v = evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm120", features,
                 _dg_lib(SM120_KERNELS - {"sm120_fp8_paged_mqa_logits"}))
    assert not v.ok and "library has no sm120_fp8_paged_mqa_logits kernel" in v.reason
    # A build stating block_kv 64 only (sgl-deep-gemm 0.2.3) refuses 32-token pages; one stating 32 or 64 takes them.
    v = evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm120", {**features, "page_size": 32},
                 _dg_lib(limits={"sm120.paged_block_kv": (64,)}))
    assert not v.ok and "page_size=32 is not in {64}, which the installed deep_gemm library states" in v.reason
    assert evaluate("get_paged_mqa_logits_metadata", "deep_gemm", "sm120", {"page_size": 32},
                    _dg_lib(limits={"sm120.paged_block_kv": (32, 64)})).ok
    assert not evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm120", {**features, "page_size": 128}, _dg_lib()).ok
    assert not evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 64, "head_dim": 64}, _dg_lib()).ok


@pytest.mark.parametrize(("n", "k", "ok"), [(24, 16384, True), (128, 64, True), (20, 16384, False),
                                            (136, 16384, False), (24, 100, False)])
def test_deep_gemm_sm120_hc_prenorm_limits(n, k, ok):
    assert evaluate("tf32_hc_prenorm_gemm", "deep_gemm", "sm120", {"n": n, "k": k}, _dg_lib()).ok == ok


def test_deep_gemm_sm120_without_library_follows_the_documented_release():
    assumed = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 64, **IDX}, _dg("2.8.1"))
    assert assumed.ok and "assumed: deep_gemm >= 2.8" in assumed.reason
    older = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 64, **IDX}, _dg("2.6.1"))
    assert not older.ok and "builds from 2.8 have it" in older.reason


def _fake_library(tmp_path, *strings: bytes, name: str = "_C.so"):
    (tmp_path / name).write_bytes(b"\x7fELF\x00" + b"\x00".join(strings) + b"\x00")
    return caps.read_deep_gemm_library(str(tmp_path))


@pytest.mark.parametrize(("clause", "expected"), [
    (b"(arch_major == 12 and (block_kv == 32 or block_kv == 64))", (32, 64)),
    (b"(arch_major == 12 and block_kv == 64) or (arch_major == 9 and block_kv == 64)", (64,)),
    (b"(arch_major == 12 and ((is_fp4 and (block_kv == 32 or block_kv == 64)) or (not is_fp4 and block_kv == 64)))",
     (64,)),
])
def test_read_deep_gemm_library(tmp_path, clause, expected):
    assert caps.read_deep_gemm_library(str(tmp_path)) is None
    lib = _fake_library(tmp_path, b"sm120_fp8_mqa_logits", b"_ZN9deep_gemm13SM120ArchSpec",
                        b"(arch_major == 10 and (block_kv == 32 or block_kv == 128)) or " + clause,
                        b"sm90_fp8_paged_mqa_logits", name="_C_extension.abi3.so")
    assert lib.kernels == {"sm120_fp8_mqa_logits", "sm90_fp8_paged_mqa_logits"}
    assert lib.limits == {"sm120.paged_block_kv": expected}
    assert "kernels for sm90, sm120" in lib.describe()


def test_read_deep_gemm_library_without_sm120():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        lib = _fake_library(Path(tmp), b"sm90_fp8_mqa_logits", b"sm100_mqa_logits")
        v = evaluate("fp8_mqa_logits", "deep_gemm", "sm120", {"num_heads": 64, **IDX},
                     {"deep_gemm": NativeStatus("deep_gemm", True, "2.6.0", library=lib)})
        assert not v.ok and "no sm120_fp8_mqa_logits kernel" in v.reason and "kernels for sm90, sm100" in v.reason


def _installed_deep_gemm_dirs() -> list[str]:
    """Directories of the DeepGEMM builds installed next to this interpreter (sgl-deep-gemm in the
    SGLang environment, the copy inside the vLLM wheel in the vLLM ones), located without importing."""
    import importlib.util
    import os

    found = []
    for top, sub in (("deep_gemm", ()), ("vllm", ("third_party", "deep_gemm"))):
        spec = importlib.util.find_spec(top)
        if spec is not None and spec.submodule_search_locations:
            path = os.path.join(next(iter(spec.submodule_search_locations)), *sub)
            if caps.read_deep_gemm_library(path) is not None:
                found.append(path)
    return found


def test_installed_deep_gemm_libraries_have_sm120_rows():
    """The real builds of the framework environments: SM120 kernels found in the library, the page
    sizes they state, and the SM120 rows they enable (a fake library covers environments without one)."""
    dirs = _installed_deep_gemm_dirs()
    if not dirs:
        pytest.skip("no DeepGEMM build installed in this environment (covered by test_read_deep_gemm_library)")
    for path in dirs:
        lib = caps.read_deep_gemm_library(path)
        version = caps.package_version_in(path)
        assert {"sm120_fp8_mqa_logits", "sm120_fp8_paged_mqa_logits", "sm120_paged_mqa_logits_metadata",
                "sm120_tf32_hc_prenorm_gemm"} <= lib.kernels, path
        assert lib.limits["sm120.paged_block_kv"] in ((64,), (32, 64)), path
        natives = {"deep_gemm": NativeStatus("deep_gemm", True, version, library=lib)}
        for heads, ok in ((16, True), (32, True), (64, True), (128, False)):
            v = evaluate("fp8_paged_mqa_logits", "deep_gemm", "sm120", {"num_heads": heads, **PAGED, "page_size": 64},
                         natives)
            assert v.ok == ok and (dict(v.padded) == {"num_heads": 32}) == (heads == 16), (path, heads, v.reason)
        page32 = evaluate("get_paged_mqa_logits_metadata", "deep_gemm", "sm120", {"page_size": 32}, natives)
        assert page32.ok == (32 in lib.limits["sm120.paged_block_kv"]), page32.reason
        assert evaluate("tf32_hc_prenorm_gemm", "deep_gemm", "sm121", {"n": 24, "k": 16384}, natives).ok


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4: DeepGEMM's MXFP4 indexer and FlashMLA's V4 decode
# ----------------------------------------------------------------------------------------------

FP4_RAGGED = {"num_heads": 64, "q_fp4": True, "compressed": False}
FP4_PAGED = {"num_heads": 64, "q_fp4": True, "next_n": 1, "page_size": 64, "context_lens_2d": True}
FP4_KERNELS = SM120_KERNELS | {"sm120_fp4_mqa_logits", "sm120_fp4_paged_mqa_logits"}


@pytest.mark.parametrize(("arch", "change", "natives", "ok", "padded"), [
    ("sm100", {}, "2.8.1", True, {}),
    ("sm103", {"num_heads": 5}, "2.8.1", True, {"num_heads": 8}),   # a multiple of 4 dividing 128
    ("sm100", {"num_heads": 128}, "2.8.1", True, {}),
    ("sm100", {"q_fp4": False}, "2.8.1", False, {}),                 # DeepGEMM's q and K share one type
    ("sm100", {}, "2.6.1", False, {}),                               # the older fp8_fp4 API is not routed
    ("sm90", {}, "2.8.1", False, {}),                                # no FP4 (MX-scaled) path on SM90
    ("sm89", {}, "2.8.1", False, {}),
    ("sm120", {}, "lib", True, {}),
    ("sm120", {"num_heads": 16}, "lib", True, {"num_heads": 32}),
    ("sm120", {}, "lib-without-fp4", False, {}),
])
def test_deep_gemm_fp4_indexer_rows(arch, change, natives, ok, padded):
    status = {"lib": _dg_lib(FP4_KERNELS), "lib-without-fp4": _dg_lib(SM120_KERNELS)}.get(natives) or _dg(natives)
    for op, features in (("fp8_fp4_mqa_logits", FP4_RAGGED), ("fp8_fp4_paged_mqa_logits", FP4_PAGED)):
        verdict = evaluate(op, "deep_gemm", arch, {**features, **change}, status)
        assert verdict.ok == ok, (op, verdict.reason)
        assert dict(verdict.padded) == padded
        if natives == "lib-without-fp4":
            assert f"no sm120_fp4_{op.removeprefix('fp8_fp4_')} kernel" in verdict.reason, verdict.reason
        # ours serves every one of these calls
        assert evaluate(op, "triton", arch, {**features, **change}, status).ok


def test_deep_gemm_fp4_paged_page_size():
    assert not evaluate("fp8_fp4_paged_mqa_logits", "deep_gemm", "sm100", {**FP4_PAGED, "page_size": 16},
                        _dg("2.8.1")).ok
    assert evaluate("fp8_fp4_paged_mqa_logits", "deep_gemm", "sm100", {**FP4_PAGED, "page_size": 32, "next_n": 4},
                    _dg("2.8.1")).ok


V4_DECODE = {"num_heads": 64, "d_qk": 512, "topk": 512, "s_q": 1, "kv_format": "fp8_ds_mla_v4", "page_size": 64}


@pytest.mark.parametrize(("arch", "change", "ok", "padded"), [
    ("sm90", {}, True, {}),
    ("sm100", {"num_heads": 8}, True, {"num_heads": 64}),
    ("sm103", {"num_heads": 100, "page_size": 256}, True, {"num_heads": 128}),
    ("sm90", {"page_size": 32}, False, {}),
    ("sm90", {"d_qk": 576}, False, {}),            # a 576-dim query is not the V4 cache's
    ("sm89", {}, False, {}),
    ("sm120", {}, False, {}),
])
def test_flash_mla_v4_decode_row(arch, change, ok, padded):
    verdict = evaluate("sparse_mla_decode", "flash_mla", arch, {**V4_DECODE, **change}, ALL_NATIVES)
    assert verdict.ok == ok, verdict.reason
    assert dict(verdict.padded) == padded
    # the V4 cache never reaches the d_qk 576 FlashInfer decode
    assert not evaluate("sparse_mla_decode", "flashinfer", arch, {**V4_DECODE, **change}, ALL_NATIVES).ok
