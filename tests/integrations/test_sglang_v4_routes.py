"""Per-call route of SGLang's DeepSeek-V4 kernels (native pass-through or nsa-backend) per GPU arch and shape,
and when the plugin installs the replacements."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from nsa_backend.routing import capabilities as caps
from nsa_backend_integrations.sglang import dsv4, plugin

NATIVES = {"flash_mla": caps.NativeStatus("flash_mla", True, "1.0.0"),
           "flashinfer": caps.NativeStatus("flashinfer", True, "0.7.2"),
           "deep_gemm": caps.NativeStatus("deep_gemm", False, error="not installed")}
NO_FLASH_MLA = {**NATIVES, "flash_mla": caps.NativeStatus("flash_mla", False, error="cuda.abi3.so did not load")}


def _fi64(num_heads: int, num_tokens: int) -> bool:
    """A FlashInfer whose DeepSeek-V4 decode lists 64 heads only."""
    return num_heads == 64 and num_tokens <= 64


@pytest.mark.parametrize("arch,heads,target", [
    ("sm80", 64, dsv4.OURS),       # SGLang: "Unsupported architecture for sparse decode fwd"
    ("sm86", 16, dsv4.OURS),
    ("sm89", 128, dsv4.OURS),
    ("sm90", 64, dsv4.NATIVE_PASS),   # FlashMLA
    ("sm90", 16, dsv4.NATIVE_PASS),   # FlashMLA on heads padded to 64 (SGLang pads them)
    ("sm100", 128, dsv4.NATIVE_PASS),
    ("sm120", 64, dsv4.NATIVE_PASS),  # FlashInfer lists 64 heads
    ("sm120", 128, dsv4.OURS),        # (heads, topk) FlashInfer does not list
    ("sm121", 16, dsv4.OURS),
])
def test_decode_route_per_arch(routing_isolated, arch, heads, target):
    route = dsv4.decode_route(arch, heads, 512, natives=NATIVES, flashinfer_v4=_fi64)
    assert route.target == target, route
    if target == dsv4.OURS:
        assert route.impl == "triton", route


def test_decode_route_without_flash_mla(routing_isolated):
    """FlashMLA not loadable on an SM90: nsa-backend serves the call."""
    route = dsv4.decode_route("sm90", 64, 512, natives=NO_FLASH_MLA, flashinfer_v4=_fi64)
    assert (route.target, route.impl) == (dsv4.OURS, "triton")
    assert "flash_mla" in route.reason


@pytest.mark.parametrize("arch,target", [("sm86", dsv4.OURS), ("sm89", dsv4.OURS), ("sm90", dsv4.NATIVE_PASS),
                                         ("sm100", dsv4.NATIVE_PASS), ("sm120", dsv4.OURS)])
def test_prefill_route_per_arch(routing_isolated, arch, target):
    assert dsv4.prefill_route(arch, 64, 512, natives=NATIVES).target == target


def test_config_choice_takes_the_call(routing_isolated, monkeypatch):
    """``NSA_BACKEND_DECODE=triton`` sends even FlashMLA-served calls to nsa-backend's kernel."""
    from nsa_backend import routing

    monkeypatch.setenv("NSA_BACKEND_DECODE", "triton")
    routing.reset_config()
    route = dsv4.decode_route("sm90", 64, 512, natives=NATIVES, flashinfer_v4=_fi64)
    assert (route.target, route.impl) == (dsv4.OURS, "triton")


@pytest.mark.parametrize("arch,target", [("sm86", dsv4.OURS), ("cpu", dsv4.OURS), ("sm90", dsv4.NATIVE_PASS),
                                         ("sm120", dsv4.NATIVE_PASS)])
def test_store_route_per_arch(routing_isolated, arch, target):
    assert dsv4.store_route(arch).target == target


def test_non_v4_calls_pass_through(routing_isolated):
    """A V3.2 call (q head dim 576, 656-byte cache) never reaches nsa-backend's V4 path."""
    import torch

    q = torch.zeros(1, 1, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 1, 656, dtype=torch.uint8)
    assert dsv4._decode_call_route(q, cache, torch.zeros(1, 1, 64, dtype=torch.int32)) is None
    v41 = torch.zeros(1, 64, 1, 528, dtype=torch.uint8)
    assert dsv4._decode_call_route(q[..., :512], v41, torch.zeros(1, 1, 64, dtype=torch.int32)) is None


class _Args:
    attention_backend = plugin.BACKEND_NAME


def test_named_backend_with_v4_model_installs(routing_isolated, monkeypatch):
    dsv4.deactivate()
    monkeypatch.delenv(plugin.TAKEOVER_ENV, raising=False)
    try:
        hf = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "index_topk": 512}
        assert plugin.route_dsv4_when_named(_Args(), hf)
        assert dsv4.active()
        import os

        assert os.environ.get(plugin.TAKEOVER_ENV) == "1"  # inherited by the scheduler / TP workers
    finally:
        dsv4.deactivate()


def test_named_backend_with_v32_model_does_not_install(routing_isolated, monkeypatch):
    dsv4.deactivate()
    monkeypatch.delenv(plugin.TAKEOVER_ENV, raising=False)
    hf = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}
    assert not plugin.route_dsv4_when_named(_Args(), hf)
    assert not dsv4.active()
