"""Routing decisions per arch (forced), explicit choices, fallbacks and the decision cache."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from nsa_backend import routing
from nsa_backend.models import load_model_config
from nsa_backend.routing import capabilities as caps
from nsa_backend.routing import router
from nsa_backend.routing.router import model_op_features, plan_routes

CUDA = torch.device("cuda", 0)   # never touched: the arch is given or forced
GLM = routing.model_info(load_model_config("glm-5"))
V4 = routing.model_info(load_model_config("deepseek-v4"))


def _glm_features(kv="fp8_e4m3", tp=1):
    return model_op_features(GLM, tp=tp, kv_cache_dtype=kv)


def test_cpu_auto_is_reference_for_every_op(all_kernels_present, natives):
    for op, feats in {**_glm_features(), **model_op_features(V4)}.items():
        assert routing.select_impl(op, "auto", {"device": torch.device("cpu"), **feats}) == "reference", op


# Expected auto routes for GLM-5 (TP=1: 64 heads, 32 indexer heads, FP8 KV) and V4's mHC GEMM with
# every native package importable.
EXPECTED = {
    "sm90": {"fp8_mqa_logits": "deep_gemm", "fp8_paged_mqa_logits": "deep_gemm",
             "get_paged_mqa_logits_metadata": "deep_gemm", "topk_indices": "triton",
             "flash_mla_sparse_fwd": "flash_mla", "sparse_mla_decode": "flash_mla",
             "tf32_hc_prenorm_gemm": "deep_gemm"},
    "sm100": {"fp8_mqa_logits": "deep_gemm", "fp8_paged_mqa_logits": "deep_gemm",
              "get_paged_mqa_logits_metadata": "deep_gemm", "topk_indices": "triton",
              "flash_mla_sparse_fwd": "flash_mla", "sparse_mla_decode": "flash_mla",
              "tf32_hc_prenorm_gemm": "deep_gemm"},
    "sm120": {"fp8_mqa_logits": "triton", "fp8_paged_mqa_logits": "triton", "get_paged_mqa_logits_metadata": "triton",
              "topk_indices": "triton", "flash_mla_sparse_fwd": "triton", "sparse_mla_decode": "flashinfer",
              "tf32_hc_prenorm_gemm": "triton"},
    "sm86": {"fp8_mqa_logits": "triton", "fp8_paged_mqa_logits": "triton", "get_paged_mqa_logits_metadata": "triton",
             "topk_indices": "triton", "flash_mla_sparse_fwd": "triton", "sparse_mla_decode": "triton",
             "tf32_hc_prenorm_gemm": "triton"},
}
EXPECTED["sm103"] = EXPECTED["sm100"]
EXPECTED["sm121"] = EXPECTED["sm120"]
EXPECTED["sm80"] = EXPECTED["sm89"] = EXPECTED["rocm"] = EXPECTED["sm86"]


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_auto_routes_per_forced_arch(arch, monkeypatch, all_kernels_present, natives):
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", arch)
    routing.reset_config()
    feats = {**_glm_features(), **{"tf32_hc_prenorm_gemm": model_op_features(V4)["tf32_hc_prenorm_gemm"]}}
    got = {op: routing.select_impl(op, "auto", {"device": CUDA, **feats[op]}) for op in EXPECTED[arch]}
    assert got == EXPECTED[arch]


def test_no_native_packages_means_triton(monkeypatch, all_kernels_present):
    routing.set_native_status({})
    for op, feats in _glm_features().items():
        impl = routing.select_impl(op, "auto", {"device": CUDA, "arch": "sm90", **feats})
        assert impl in ("triton", "reference"), op
        assert impl == "triton" or op in ("pack_indexer_k_cache", "unpack_fp8_ds_mla"), op


def test_native_unsupported_shape_falls_back_to_triton(all_kernels_present, natives):
    feats = {"device": CUDA, "arch": "sm90", "num_heads": 128, "head_dim": 128, "compressed": False}
    assert routing.select_impl("fp8_mqa_logits", "auto", feats) == "triton"       # DeepGEMM SM90 H <= 64
    dec = {"device": CUDA, "arch": "sm120", **_glm_features()["sparse_mla_decode"], "topk": 1000}
    assert routing.select_impl("sparse_mla_decode", "auto", dec) == "triton"      # not a FlashInfer bucket


def test_gpu_without_triton_kernel_uses_reference_only_as_last_resort(all_kernels_present, natives):
    # pack_indexer_k_cache has no GPU kernel in the dispatch table.
    assert routing.select_impl("pack_indexer_k_cache", "auto", {"device": CUDA, "arch": "sm90"}) == "reference"


def test_explicit_choice_is_validated(all_kernels_present, natives):
    feats = {"device": CUDA, "arch": "sm120", **_glm_features()["sparse_mla_decode"]}
    with pytest.raises(ValueError) as info:
        routing.select_impl("sparse_mla_decode", "flash_mla", feats)
    msg = str(info.value)
    for part in ("sparse_mla_decode", "'flash_mla'", "sm120", "no sparse_mla_decode kernel for sm120",
                 "Valid choices for this call: ['auto', 'reference', 'triton', 'flashinfer']"):
        assert part in msg, (part, msg)
    assert routing.select_impl("sparse_mla_decode", "flashinfer", feats) == "flashinfer"
    assert routing.select_impl("sparse_mla_decode", "reference", feats) == "reference"


def test_explicit_native_missing_package(all_kernels_present):
    routing.set_native_status({})
    feats = {"device": CUDA, "arch": "sm90", "num_heads": 64, "head_dim": 128, "compressed": False}
    with pytest.raises(ValueError, match=r"deep_gemm is not importable .*Valid choices for this call: "
                                         r"\['auto', 'reference', 'triton'\]"):
        routing.select_impl("fp8_mqa_logits", "deep_gemm", feats)


def test_explicit_impl_without_implementation(all_kernels_present, natives):
    with pytest.raises(ValueError, match="nsa-backend has no flash_mla implementation of topk_indices"):
        routing.select_impl("topk_indices", "flash_mla", {"device": CUDA, "arch": "sm90", "topk": 8})
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        routing.select_impl("topk_indices", "cuda", {"device": CUDA, "arch": "sm90", "topk": 8})
    with pytest.raises(ValueError, match="unknown op"):
        routing.select_impl("dense_attention", "auto", {"device": CUDA, "arch": "sm90"})


def test_explicit_gpu_impl_on_cpu(all_kernels_present, natives, monkeypatch):
    feats = {"device": torch.device("cpu"), "topk": 8}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"needs a GPU and the tensors are on the CPU.*\['auto', 'reference'\]"):
        routing.select_impl("topk_indices", "triton", feats)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    routing.clear_cache()
    assert routing.select_impl("topk_indices", "triton", feats) == "triton"


def test_unusable_config_choice_falls_back_with_warning(monkeypatch, all_kernels_present, natives, caplog):
    monkeypatch.setenv("NSA_BACKEND_DECODE", "flashinfer")
    routing.reset_config()
    feats = {"device": CUDA, "arch": "sm90", **_glm_features()["sparse_mla_decode"]}
    with caplog.at_level(logging.WARNING, logger="nsa_backend"):
        assert routing.select_impl("sparse_mla_decode", "auto", feats) == "flash_mla"
    assert "env NSA_BACKEND_DECODE selects flashinfer for sparse_mla_decode" in caplog.text
    # A family value that names no implementation of the op is ignored for that op.
    assert routing.select_impl("pack_fp8_ds_mla", "auto", {"device": CUDA, "arch": "sm90"}) == "triton"


def test_decision_cache_is_hit_and_fast(all_kernels_present, natives):
    feats = {"device": CUDA, "arch": "sm90", "num_heads": 32, "head_dim": 128, "compressed": False}
    routing.clear_cache()
    assert routing.select_impl("fp8_mqa_logits", "auto", feats) == "deep_gemm"
    assert routing.stats.misses == 1 and routing.stats.hits == 0
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        routing.select_impl("fp8_mqa_logits", "auto", feats)
    per_call_us = (time.perf_counter() - start) / n * 1e6
    print(f"\ncached select_impl: {per_call_us:.2f} us per call")
    assert routing.stats.hits == n and routing.stats.misses == 1


def test_cache_key_is_the_shape_class(all_kernels_present, natives):
    routing.clear_cache()
    for n in (100, 5000, 70000):   # top-k routes do not depend on the row length
        routing.select_impl("topk_indices", "auto", {"device": CUDA, "arch": "sm90", "topk": 2048, "n": n})
    assert routing.stats.misses == 1 and routing.stats.hits == 2
    routing.select_impl("fp8_mqa_logits", "auto", {"device": CUDA, "arch": "sm90", "num_heads": 16, "head_dim": 128})
    routing.select_impl("fp8_mqa_logits", "auto", {"device": CUDA, "arch": "sm90", "num_heads": 64, "head_dim": 128})
    assert routing.stats.misses == 3


def test_cached_device_arch(monkeypatch, all_kernels_present, natives):
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm100")
    routing.reset_config()
    feats = {"device": CUDA, "num_heads": 16, "head_dim": 128, "compressed": False}
    assert routing.select_impl("fp8_mqa_logits", "auto", feats) == "deep_gemm"
    assert router._arch_cache[CUDA] == "sm100"


@pytest.mark.parametrize(("op", "impl", "arch", "heads", "padded"), [
    ("fp8_mqa_logits", "deep_gemm", "sm90", 16, 32),
    ("fp8_mqa_logits", "deep_gemm", "sm90", 64, 64),
    ("fp8_mqa_logits", "deep_gemm", "sm100", 16, 16),
    ("fp8_paged_mqa_logits", "deep_gemm", "sm90", 8, 32),
    ("flash_mla_sparse_fwd", "flash_mla", "sm90", 16, 64),
    ("sparse_mla_decode", "flash_mla", "sm100", 100, 128),
    ("sparse_mla_decode", "flashinfer", "sm120", 12, 16),
    ("fp8_mqa_logits", "deep_gemm", "sm89", 16, 16),    # no kernel: unchanged
])
def test_get_padded_heads(natives, op, impl, arch, heads, padded):
    assert routing.get_padded_heads(op, impl, heads, arch=arch) == padded


def test_get_padded_heads_follows_installed_version():
    routing.set_native_status({"deep_gemm": caps.NativeStatus("deep_gemm", True, "2.3.0")})
    assert routing.get_padded_heads("fp8_mqa_logits", "deep_gemm", 32, arch="sm100") == 64


def test_plan_routes_with_framework_choice(all_kernels_present, natives):
    decisions = {d.op: d for d in plan_routes(GLM, "sm120", kv_cache_dtype="fp8_e4m3", tp=4,
                                              prefill_impl="flashinfer_sparse_mla",
                                              decode_impl="flashinfer_sparse_mla")}
    assert decisions["flash_mla_sparse_fwd"].impl == "framework:flashinfer_sparse_mla"
    assert decisions["sparse_mla_decode"].impl == "flashinfer"
    assert decisions["sparse_mla_decode"].source == "--decode-impl"
    assert decisions["fp8_mqa_logits"].impl == "triton"
    v4 = {d.op: d for d in plan_routes(V4, "sm90", kv_cache_dtype="bfloat16", decode_impl="triton")}
    assert v4["tf32_hc_prenorm_gemm"].impl == "deep_gemm"
    assert v4["sparse_mla_decode"].impl == "triton"
    assert "pack_fp8_ds_mla" not in v4


FEW_HEAD_PREFILL = {"device": CUDA, "arch": "sm90", "num_heads": 16, "d_qk": 576, "topk": 2048}
FEW_HEAD_DECODE = {"device": CUDA, "arch": "sm90", "num_heads": 16, "d_qk": 576, "topk": 2048, "s_q": 1,
                   "kv_format": "fp8_ds_mla", "page_size": 64}


@pytest.mark.parametrize(("op", "feats", "gluon", "want"), [
    # the few-head Gluon kernels beat FlashMLA on heads padded to 64 (sm_90)
    ("flash_mla_sparse_fwd", FEW_HEAD_PREFILL, True, "triton"),
    ("flash_mla_sparse_fwd", {**FEW_HEAD_PREFILL, "num_heads": 32}, True, "triton"),
    ("sparse_mla_decode", FEW_HEAD_DECODE, True, "triton"),
    # without Gluon the tl kernels are slower than the padded native kernel
    ("flash_mla_sparse_fwd", FEW_HEAD_PREFILL, False, "flash_mla"),
    ("sparse_mla_decode", FEW_HEAD_DECODE, False, "flash_mla"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "num_heads": 24}, True, "triton"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "num_heads": 32}, True, "triton"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "num_heads": 32}, False, "flash_mla"),
    # outside the measured shapes: native heads, d_qk 512 (no few-head kernel), more than 32 heads
    ("flash_mla_sparse_fwd", {**FEW_HEAD_PREFILL, "num_heads": 64}, True, "flash_mla"),
    ("flash_mla_sparse_fwd", {**FEW_HEAD_PREFILL, "num_heads": 33}, True, "flash_mla"),
    ("flash_mla_sparse_fwd", {**FEW_HEAD_PREFILL, "d_qk": 512}, True, "flash_mla"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "num_heads": 33}, True, "flash_mla"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "num_heads": 64}, True, "flash_mla"),
    # other archs keep their routes
    ("flash_mla_sparse_fwd", {**FEW_HEAD_PREFILL, "arch": "sm100"}, True, "flash_mla"),
    ("sparse_mla_decode", {**FEW_HEAD_DECODE, "arch": "sm100"}, True, "flash_mla"),
])
def test_auto_takes_triton_over_padded_native(monkeypatch, all_kernels_present, natives, op, feats, gluon, want):
    monkeypatch.setattr(caps, "gluon_usable", lambda arch: gluon)
    router._cache.clear()
    assert routing.select_impl(op, "auto", feats) == want
    decision = router.decide(op, "auto", feats["arch"], feats)
    assert decision.impl == want
    if want == "triton":
        assert "would pad num_heads" in decision.reason and "faster than FlashMLA" in decision.reason
        # an explicit request for the native kernel still runs it on padded heads
        assert routing.select_impl(op, "flash_mla", feats) == "flash_mla"


def test_gluon_usable_follows_the_switch(monkeypatch):
    from nsa_backend.kernels import _gluon

    monkeypatch.setattr(_gluon, "gluon_importable", lambda: True)
    monkeypatch.setattr(_gluon.envs, "triton_interpret", lambda: False)
    monkeypatch.setenv("NSA_BACKEND_GLUON", "1")
    assert caps.gluon_usable("sm90")
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    assert not caps.gluon_usable("sm90")
    assert not caps.gluon_usable("rocm")


def test_plan_names_the_sparse_mla_kernel_the_triton_launcher_takes(monkeypatch, all_kernels_present):
    """With no native package the plan's Triton routes for the sparse MLA ops name the launcher's own choice for the
    planned shapes: the Gluon kernel written for the arch where this Triton has Gluon, the portable tile elsewhere."""
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.kernels.sparse_mla_decode import DECODE_KERNELS
    from nsa_backend.kernels.sparse_mla_prefill import PREFILL_KERNELS
    from nsa_backend.routing.triton_kernels import V4_DECODE_KERNEL

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the question launches nothing
    v32 = routing.model_info(load_model_config("deepseek-v3.2"))

    def reasons(info, arch, kv):
        return {d.op: d.reason for d in plan_routes(info, arch, kv_cache_dtype=kv, tp=8, natives={})}

    gluon = gluon_importable()
    sm120 = reasons(v32, "sm120", "fp8_e4m3")
    assert sm120["sparse_mla_decode"].startswith(f"Triton: {DECODE_KERNELS['sm89_gluon' if gluon else 'portable']}; ")
    assert sm120["flash_mla_sparse_fwd"].startswith(f"Triton: {PREFILL_KERNELS['sm80_gluon' if gluon else 'portable']}")
    assert "flash_mla has no flash_mla_sparse_fwd kernel for sm120" in sm120["flash_mla_sparse_fwd"]
    assert caps.TRITON_NOTE not in sm120["flash_mla_sparse_fwd"] + sm120["sparse_mla_decode"]  # named instead
    sm86_bf16 = reasons(v32, "sm86", "bfloat16")
    assert sm86_bf16["sparse_mla_decode"].startswith(f"Triton: {DECODE_KERNELS['sm80_gluon' if gluon else 'portable']}")
    sm86_fp8 = reasons(v32, "sm86", "fp8_e4m3")
    assert sm86_fp8["sparse_mla_decode"].startswith(f"Triton: {DECODE_KERNELS['sm89_gluon' if gluon else 'portable']}")
    assert reasons(v32, "sm100", "fp8_e4m3")["sparse_mla_decode"].startswith(f"Triton: {DECODE_KERNELS['portable']}")
    assert reasons(V4, "sm86", "fp8_e4m3")["sparse_mla_decode"].startswith(f"Triton: {V4_DECODE_KERNEL}")
    # ops whose launcher has one kernel keep the general note
    assert sm120["topk_indices"] == caps.TRITON_NOTE
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    assert reasons(v32, "sm120", "fp8_e4m3")["sparse_mla_decode"].startswith(f"Triton: {DECODE_KERNELS['portable']}")
