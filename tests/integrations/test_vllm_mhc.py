"""vLLM integration: which DeepGEMM kernels vLLM keeps (indexer per layer shape, mHC GEMM per call),
read from the DeepGEMM build vLLM loads (the copy inside the installed vLLM wheel)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from nsa_backend_integrations.vllm import config, mhc  # noqa: E402


@pytest.fixture(autouse=True)
def deep_gemm_enabled(monkeypatch):
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    monkeypatch.setattr(config, "_vllm_deep_gemm_disabled", lambda: None)   # this machine's nvcc is not the point
    mhc._native_serves.cache_clear()
    yield
    mhc._native_serves.cache_clear()


def test_vllm_deep_gemm_is_read_from_the_wheel():
    status = config.vllm_deep_gemm_status()
    assert status.available and status.library is not None, status.error
    assert "sm120_fp8_paged_mqa_logits" in status.library.kernels


@pytest.mark.parametrize(("arch", "heads", "page", "served", "why"), [
    ("sm120", 16, 64, False, "needs zero-padding (num_heads 16 -> 32), which vLLM does not do"),
    ("sm120", 32, 64, True, "sm120_fp8_paged_mqa_logits"),      # GLM-5
    ("sm121", 64, 64, True, "sm120_fp8_mqa_logits"),            # DeepSeek-V3.2
    ("sm120", 128, 64, False, "num_heads=128 is not in {32, 64}"),
    ("sm120", 64, 128, False, "page_size=128"),
    ("sm90", 64, 64, True, "native kernels"),
    ("sm100", 16, 64, True, "native kernels"),
    ("sm89", 64, 64, False, "no fp8_mqa_logits kernel for sm89"),
    ("sm80", 32, 64, False, "no fp8_mqa_logits kernel for sm80"),
])
def test_deep_gemm_serves_indexer(arch, heads, page, served, why):
    ok, reason = config.deep_gemm_serves_indexer(arch, heads, 128, page)
    assert ok == served and why in reason, reason


def test_deep_gemm_serves_indexer_page_32_as_the_build_states():
    allowed = config.vllm_deep_gemm_status().library.limits["sm120.paged_block_kv"]
    ok, reason = config.deep_gemm_serves_indexer("sm120", 64, 128, 32)
    assert ok == (32 in allowed), reason


def test_deep_gemm_serves_indexer_refusals(monkeypatch):
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        config.deep_gemm_serves_indexer("sm120", 0, 128, 64)
    monkeypatch.undo()   # the real check: vLLM's own switch turns DeepGEMM off
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    ok, reason = config.deep_gemm_serves_indexer("sm120", 64, 128, 64)
    assert not ok and "VLLM_USE_DEEP_GEMM=0" in reason


def test_deep_gemm_has_kernels_is_read_from_the_library():
    assert [a for a in ("sm80", "sm89", "sm90", "sm100", "sm120", "sm121") if config.deep_gemm_has_kernels(a)] == \
        ["sm90", "sm100", "sm120", "sm121"]


@pytest.mark.parametrize(("arch", "n", "k", "mode", "uses_nsa"), [
    ("sm120", 24, 64, "auto", False),      # DeepSeek-V4: hc_mult 4 -> N = 24, DeepGEMM's SM120 kernel
    ("sm121", 24, 64, "auto", False),
    ("sm90", 40, 64, "auto", True),        # SM90 kernel: N <= 32
    ("sm100", 40, 64, "auto", False),
    ("sm89", 24, 64, "auto", True),
    ("sm120", 24, 64, "on", True),
])
def test_hc_prenorm_gemm_native_first(monkeypatch, arch, n, k, mode, uses_nsa):
    import nsa_backend.routing

    monkeypatch.setattr(nsa_backend.routing, "detect_arch", lambda device=None: arch)
    calls = []
    routed = mhc.make_routed(lambda *args: calls.append(args), mode)
    monkeypatch.setattr(mhc, "_use_nsa", lambda m, device, fn, _f=mhc._use_nsa: _f(m, torch.device("cuda", 0), fn))
    x, fn = torch.randn(2, k).to(torch.bfloat16), torch.randn(n, k)
    out, sqrsum = torch.empty(2, n), torch.empty(2)
    routed(x, fn, out, sqrsum, 1)
    assert (len(calls) == 0) == uses_nsa
    if uses_nsa:
        torch.testing.assert_close(out, x.float() @ fn.T)
