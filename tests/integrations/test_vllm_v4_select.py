"""Which DeepSeek-V4 attention class vLLM builds once nsa-backend's plugin has wrapped
``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls``.

Cases: GPU arch sm89 / sm90 / sm120 (vLLM's own selector reads the platform's device capability,
replaced here; nsa-backend's decision gets the arch family), nsa-backend named (``CUSTOM`` while it is
nsa-backend's, a served takeover name) or under takeover with no backend named, with (heads, top-k)
that vLLM's kernel serves or not. vLLM's FlashMLA library and FlashInfer's SM120 dispatch table are
not on this CPU machine: the tests state what they report (a FlashMLA library present, the FlashInfer
pairs in the table) through the two functions vLLM and nsa-backend consult.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from tests.integrations import vllm_fixtures as vf  # noqa: E402
from tests.integrations import vllm_v4_layer_support as ls  # noqa: E402

FLASHMLA = "DeepseekV4FlashMLAAttention"
FLASHINFER = "DeepseekV4FlashInferSM120Attention"
NSA = "NsaDeepseekV4Attention"
CAPABILITY = {"sm89": (8, 9), "sm90": (9, 0), "sm120": (12, 0)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    vf.cpu_platform()
    return vf.model_dir(tmp_path_factory, "dsv4-select", ls.LAYER_CONFIG)


@pytest.fixture(scope="module")
def plugin_and_dsv4():
    from nsa_backend_integrations.vllm import dsv4, plugin

    plugin.register()
    return plugin, dsv4


@pytest.fixture
def world(monkeypatch, plugin_and_dsv4):
    """vLLM's backend overrides restored after the test; FlashMLA reported as compiled in;
    FlashInfer's SM120 DeepSeek-V4 table holding only (64 heads, top-k 128)."""
    import vllm.utils.flashinfer as vllm_flashinfer
    from vllm.v1.attention.backends import registry

    from nsa_backend.routing import capabilities as caps

    plugin, dsv4 = plugin_and_dsv4
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    monkeypatch.setattr(dsv4, "_vllm_flash_mla", lambda: caps.NativeStatus("flash_mla", True, vllm.__version__))
    monkeypatch.setattr(vllm_flashinfer, "has_flashinfer_sparse_mla_sm120_config",
                        lambda heads, topk: (heads, topk) == (64, 128))
    return plugin, dsv4


def _config(model_dir: str, backend: str | None, heads: int = 4):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = ls.make_vllm_config(model_dir)
    config.model_config.hf_config.num_attention_heads = heads
    config.model_config.hf_config.sliding_window = 128
    config.attention_config.backend = None if backend is None else AttentionBackendEnum[backend]
    return config


def _select(world, monkeypatch, model_dir, arch, *, backend=None, takeover="off", heads=4) -> str:
    from vllm.models.deepseek_v4.nvidia import model
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from nsa_backend_integrations.vllm.config import VllmSettings, load_settings

    plugin, dsv4 = world
    major, minor = CAPABILITY[arch]
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda device_id=0: DeviceCapability(major, minor))
    settings = load_settings(overrides={"takeover": takeover})
    if settings.takeover:
        names = plugin.auto_takeover_names(arch) if settings.takeover == "auto" else settings.takeover
        plugin._register_backends(VllmSettings(takeover=names), arch)
    monkeypatch.setattr(model, "_select_dsv4_attn_cls", model._select_dsv4_attn_cls)
    dsv4.install(settings, lambda: arch)
    return model._select_dsv4_attn_cls(_config(model_dir, backend, heads)).__name__


# (arch, heads, expected with takeover on and no backend named): what vLLM's kernels serve.
TAKEOVER_CASES = [
    ("sm89", 4, NSA),            # FlashMLA has no SM8x kernel
    ("sm89", 64, NSA),
    ("sm90", 4, FLASHMLA),       # FlashMLA pads 4 heads to 64
    ("sm90", 64, FLASHMLA),
    ("sm90", 256, NSA),          # FlashMLA's V4 decode takes at most 128 heads
    ("sm120", 64, FLASHINFER),   # (64, window 128) is in FlashInfer's table
    ("sm120", 4, NSA),           # 4 heads pad to 8: (8, 128) is not
    ("sm120", 256, NSA),         # beyond FlashInfer's head buckets
]


@pytest.mark.parametrize(("arch", "heads", "expected"), TAKEOVER_CASES)
def test_takeover_picks_nsa_where_no_native_kernel_serves(world, monkeypatch, model_dir, arch, heads, expected):
    assert _select(world, monkeypatch, model_dir, arch, takeover="auto", heads=heads) == expected


@pytest.mark.parametrize(("arch", "heads"), [(a, h) for a, h, _ in TAKEOVER_CASES])
def test_takeover_off_keeps_vllms_choice(world, monkeypatch, model_dir, arch, heads):
    expected = FLASHINFER if arch == "sm120" else FLASHMLA
    assert _select(world, monkeypatch, model_dir, arch, heads=heads) == expected


@pytest.mark.parametrize("arch", list(CAPABILITY))
def test_custom_named_picks_nsa_on_every_arch(world, monkeypatch, model_dir, arch):
    assert _select(world, monkeypatch, model_dir, arch, backend="CUSTOM", heads=64) == NSA


@pytest.mark.parametrize(("arch", "name"), [("sm90", "FLASHMLA_SPARSE"), ("sm89", "FLASHMLA_SPARSE"),
                                            ("sm120", "FLASHINFER_MLA_SPARSE_SM120")])
def test_served_takeover_name_named_picks_nsa(world, monkeypatch, model_dir, arch, name):
    """A takeover name nsa-backend serves, named on the command line, is a request for nsa-backend
    even where vLLM has a kernel (vLLM itself refuses FLASHINFER_MLA_SPARSE_SM120 for DeepSeek-V4)."""
    assert _select(world, monkeypatch, model_dir, arch, backend=name, takeover=name, heads=64) == NSA


@pytest.mark.parametrize(("arch", "backend", "expected"), [
    ("sm89", "FLASHMLA_SPARSE_DSV4", FLASHMLA),      # vLLM's own V4 backend named: vLLM's class
    ("sm120", "FLASHINFER_MLA_SPARSE_DSV4", FLASHINFER),
])
def test_named_vllm_backend_is_kept_under_takeover(world, monkeypatch, model_dir, arch, backend, expected):
    assert _select(world, monkeypatch, model_dir, arch, backend=backend, takeover="auto", heads=4) == expected


def test_custom_of_another_plugin_is_not_a_request(world, monkeypatch, model_dir):
    from vllm.v1.attention.backends import registry

    monkeypatch.setitem(registry._ATTN_OVERRIDES, registry.AttentionBackendEnum.CUSTOM, "other.plugin.Backend")
    assert _select(world, monkeypatch, model_dir, "sm90", backend="CUSTOM") == FLASHMLA


def test_missing_flashmla_library_is_taken_over(world, monkeypatch, model_dir):
    """A vLLM wheel without its FlashMLA library (``vllm._flashmla_C``) serves no arch."""
    from nsa_backend.routing import capabilities as caps

    _, dsv4 = world
    monkeypatch.setattr(dsv4, "_vllm_flash_mla",
                        lambda: caps.NativeStatus("flash_mla", False, None, "vllm._flashmla_C is not available"))
    assert _select(world, monkeypatch, model_dir, "sm90", takeover="auto", heads=64) == NSA


def test_plugin_registration_installs_the_selector(plugin_and_dsv4):
    import importlib

    plugin, dsv4 = plugin_and_dsv4
    state = plugin.registration_state()
    assert "deepseek-v4 attention" not in state["errors"], state["errors"]
    assert state["deepseek_v4"] == f"{dsv4.MODEL_MODULE}.{dsv4.SELECTOR}"
    selector = getattr(importlib.import_module(dsv4.MODEL_MODULE), dsv4.SELECTOR)
    assert selector.nsa_backend_original.__module__ == dsv4.MODEL_MODULE
