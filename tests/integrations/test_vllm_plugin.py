"""vLLM integration, registration side: entry point, backend registry, CLI and backend validation.

Runs against the real vLLM release in the environment made by ``scripts/vllm-env.sh`` (skipped
where vLLM is not installed). Everything runs on the CPU: vLLM's CUDA platform is exercised
through its classmethods with a stubbed compute capability.
"""

from __future__ import annotations

import sys
import types

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from nsa_backend_integrations.vllm import plugin  # noqa: E402
from nsa_backend_integrations.vllm.backend import (  # noqa: E402
    FlashInferSM120TakeoverBackend,
    FlashMLASparseTakeoverBackend,
    NsaSparseMLABackend,
)
from nsa_backend_integrations.vllm.config import VllmSettings, load_settings  # noqa: E402
from tests.integrations import vllm_fixtures as vf  # noqa: E402

# The same model without the indexer: dense MLA (DeepSeek-V3).
DENSE_CONFIG = {
    **{k: v for k, v in vf.DSA_CONFIG.items() if not k.startswith("index_")},
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
}

ACCEPTED_CAPABILITIES = [(12, 0), (12, 1), (9, 0), (10, 0), (8, 9)]


@pytest.fixture(scope="module")
def cpu_platform():
    return vf.cpu_platform()


@pytest.fixture(scope="module")
def loaded(cpu_platform):
    """Run vLLM's own general-plugin loader once (as every vLLM process does at start-up)."""
    import vllm.plugins

    calls = plugin.registration_state()["calls"]
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    state = plugin.registration_state()
    assert state["calls"] == calls + 1  # vLLM's loader called the entry point
    return state


@pytest.fixture(scope="module")
def dsa_config(tmp_path_factory, cpu_platform):
    return vf.vllm_config(vf.model_dir(tmp_path_factory, "dsa", vf.DSA_CONFIG))


@pytest.fixture(scope="module")
def dense_config(tmp_path_factory, cpu_platform):
    return vf.vllm_config(vf.model_dir(tmp_path_factory, "dense", DENSE_CONFIG))


def _validate(backend, capability=(12, 0), **overrides) -> list[str]:
    """``validate_configuration`` with the arguments vLLM's MLA selector passes for a DSA layer."""
    args = dict(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype="fp8_ds_mla",
        block_size=64,
        use_mla=True,
        has_sink=False,
        use_sparse=True,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(*capability),
        attn_type="decoder",
    )
    args.update(overrides)
    return backend.validate_configuration(**args)


# ---------------------------------------------------------------------------------------------
# Entry point and registration
# ---------------------------------------------------------------------------------------------


def test_vllm_plugin_loader_finds_and_runs_entry_point(loaded):
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert found["nsa_backend"] is plugin.register
    assert loaded["registered"] and loaded["calls"] >= 1
    assert loaded["errors"] == {}
    assert loaded["custom_backend"] == plugin.CUSTOM_BACKEND_PATH
    assert loaded["indexer"] == "nsa_backend_integrations.vllm.indexer.NsaSparseAttnIndexer"
    assert loaded["hc_prenorm"] is True


def test_register_is_idempotent(loaded):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.utils import deep_gemm

    routed = deep_gemm.tf32_hc_prenorm_gemm
    before = plugin.registration_state()
    plugin.register()
    plugin.register()
    after = plugin.registration_state()
    assert after["calls"] == before["calls"] + 2
    assert {k: v for k, v in after.items() if k != "calls"} == {
        k: v for k, v in before.items() if k != "calls"
    }
    assert op_registry_oot["SparseAttnIndexer"].__name__ == "NsaSparseAttnIndexer"
    assert deep_gemm.tf32_hc_prenorm_gemm is routed
    assert not hasattr(routed.nsa_backend_original, "nsa_backend_original")  # wrapped once


def test_custom_enum_resolves_to_our_backend(loaded):
    assert AttentionBackendEnum.CUSTOM.get_class() is NsaSparseMLABackend
    assert AttentionBackendEnum["CUSTOM"].get_path() == plugin.CUSTOM_BACKEND_PATH
    assert NsaSparseMLABackend.get_name() == "CUSTOM"
    assert NsaSparseMLABackend.is_mla() and NsaSparseMLABackend.is_sparse()


def test_attention_backend_custom_parses_through_engine_args(loaded, tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = vf.model_dir(tmp_path_factory, "cli", vf.DSA_CONFIG)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            model,
            "--attention-backend",
            "CUSTOM",
            "--kv-cache-dtype",
            "fp8_ds_mla",
            "--block-size",
            "64",
            "--skip-tokenizer-init",
            "--max-model-len",
            "4096",
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.attention_config.backend is AttentionBackendEnum.CUSTOM
    assert config.attention_config.backend.get_class() is NsaSparseMLABackend
    assert config.cache_config.cache_dtype == "fp8_ds_mla"


# ---------------------------------------------------------------------------------------------
# validate_configuration, as vLLM's selector calls it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "bfloat16", "auto"])
@pytest.mark.parametrize("capability", ACCEPTED_CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_validate_configuration_accepts_dsa(loaded, dsa_config, capability, kv_cache_dtype):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(dsa_config):
        assert _validate(NsaSparseMLABackend, capability, kv_cache_dtype=kv_cache_dtype) == []


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(device_capability=DeviceCapability(7, 5)), "compute capability not supported"),
        (dict(dtype=torch.float16), "dtype not supported"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype not supported"),  # CUSTOM: pass fp8_ds_mla explicitly
        (dict(kv_cache_dtype="nvfp4_ds_mla"), "kv_cache_dtype not supported"),
        (dict(block_size=16), "block_size not supported"),
        (dict(head_size=128), "head_size not supported"),
        (dict(use_mla=False), "non-MLA not supported"),
        (dict(use_sparse=False), "non-sparse not supported"),
        (dict(has_sink=True), "attention sinks not supported"),
        (dict(use_dcp=True), "DCP not supported"),
        (dict(use_pcp=True), "PCP not supported"),
        (dict(attn_type="encoder"), "attention type encoder not supported"),
    ],
    ids=[
        "sm75",
        "fp16",
        "fp8-alias",
        "nvfp4",
        "block16",
        "head128",
        "dense-mla",
        "non-sparse",
        "sink",
        "dcp",
        "pcp",
        "encoder",
    ],
)
def test_validate_configuration_rejects_with_vllm_reasons(loaded, dsa_config, overrides, reason):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(dsa_config):
        assert reason in _validate(NsaSparseMLABackend, **overrides)


def test_validate_configuration_rejects_model_without_indexer(loaded, dense_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(dense_config):
        reasons = _validate(NsaSparseMLABackend)
    assert reasons == ["CUSTOM (nsa-backend) requires a model with index_topk config"]


def test_validate_configuration_rejects_rope_free_fp8(loaded, dsa_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(dsa_config):
        assert _validate(NsaSparseMLABackend, head_size=512, kv_cache_dtype="bfloat16") == []
        reasons = _validate(NsaSparseMLABackend, head_size=512, kv_cache_dtype="fp8_ds_mla")
        assert len(reasons) == 1 and "head_size 512 needs a bf16 cache" in reasons[0]
        # Under the SM120 name vLLM turns "auto" into fp8_ds_mla, so the same rule applies.
        assert _validate(FlashInferSM120TakeoverBackend, head_size=512, kv_cache_dtype="auto") != []


# ---------------------------------------------------------------------------------------------
# Selection through vLLM's CUDA platform
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_platform_cls():
    """vLLM's CUDA platform class. Its module loads vLLM's CUDA extension, which needs the CUDA
    driver; without a driver a stand-in module is put in its place, as selection is pure Python."""
    try:
        from vllm.platforms.cuda import CudaPlatform
    except ImportError as exc:
        if "libcuda" not in str(exc):
            raise
        sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        from vllm.platforms.cuda import CudaPlatform
    return CudaPlatform


def _select(monkeypatch, platform_cls, capability, selected, kv_cache_dtype="fp8_ds_mla"):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    CudaPlatform = platform_cls

    monkeypatch.setattr(
        CudaPlatform,
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
    )
    selector = AttentionSelectorConfig(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=64,
        use_mla=True,
        use_sparse=True,
    )
    return CudaPlatform.get_attn_backend_cls(selected, selector, num_heads=4)


@pytest.mark.parametrize("capability", ACCEPTED_CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_cuda_selector_accepts_custom(loaded, dsa_config, cuda_platform_cls, monkeypatch, capability):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(dsa_config):
        path = _select(monkeypatch, cuda_platform_cls, capability, AttentionBackendEnum.CUSTOM)
    assert path == plugin.CUSTOM_BACKEND_PATH


def test_cuda_selector_refuses_custom_on_turing(loaded, dsa_config, cuda_platform_cls, monkeypatch):
    from vllm.config import set_current_vllm_config

    with (
        set_current_vllm_config(dsa_config),
        pytest.raises(ValueError, match="compute capability not supported"),
    ):
        _select(monkeypatch, cuda_platform_cls, (7, 5), AttentionBackendEnum.CUSTOM)


@pytest.fixture
def restore_overrides():
    from vllm.v1.attention.backends import registry

    saved = dict(registry._ATTN_OVERRIDES)
    yield
    registry._ATTN_OVERRIDES.clear()
    registry._ATTN_OVERRIDES.update(saved)


@pytest.mark.parametrize(
    "arch, capability, name, cls",
    [
        ("sm120", (12, 0), "FLASHINFER_MLA_SPARSE_SM120", FlashInferSM120TakeoverBackend),
        ("sm121", (12, 1), "FLASHINFER_MLA_SPARSE_SM120", FlashInferSM120TakeoverBackend),
        ("sm89", (8, 9), "FLASHMLA_SPARSE", FlashMLASparseTakeoverBackend),
    ],
)
def test_takeover_auto_becomes_vllm_default(
    loaded, dsa_config, cuda_platform_cls, monkeypatch, restore_overrides, arch, capability, name, cls
):
    from vllm.config import set_current_vllm_config

    assert plugin._register_backends(VllmSettings(takeover="auto"), arch) == (name,)
    assert AttentionBackendEnum[name].get_class() is cls
    assert cls.get_name() == name
    with set_current_vllm_config(dsa_config):
        # No --attention-backend: vLLM's own priority list now lands on nsa-backend.
        path = _select(monkeypatch, cuda_platform_cls, capability, None, kv_cache_dtype="fp8")
    assert path == f"{cls.__module__}.{cls.__qualname__}"


def test_takeover_off_by_default(loaded, monkeypatch, restore_overrides):
    monkeypatch.delenv("NSA_BACKEND_VLLM_TAKEOVER", raising=False)
    monkeypatch.delenv("NSA_BACKEND_CONFIG", raising=False)
    assert load_settings().takeover == ()
    assert plugin._register_backends(load_settings(), "sm120") == ()
    assert not AttentionBackendEnum.FLASHMLA_SPARSE.is_overridden()


@pytest.mark.parametrize("arch", ["sm120", "sm121", "sm89", "sm80", "sm90", "sm100", "sm103", None])
def test_auto_replacements_install_and_decide_per_shape(arch):
    """``auto`` installs both replacements on every GPU; the shape decides per layer / call."""
    assert plugin.planned_replacements(VllmSettings(), arch) == (True, True)
    forced = VllmSettings(indexer="on", hc_prenorm="on")
    assert plugin.planned_replacements(forced, arch) == (True, True)
    assert plugin.planned_replacements(VllmSettings(indexer="off", hc_prenorm="off"), arch) == (False, False)


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120", "sm89", "sm80"])
@pytest.mark.parametrize("heads", [64, 16])
def test_auto_indexer_layer_keeps_deep_gemm_where_it_serves_the_shape(monkeypatch, arch, heads):
    """An indexer layer runs on nsa-backend in ``auto`` exactly where vLLM's DeepGEMM does not serve
    its head count on this GPU (``config.deep_gemm_serves_indexer``)."""
    import nsa_backend.routing
    from nsa_backend_integrations.vllm import config
    from nsa_backend_integrations.vllm import indexer as nsa_indexer

    monkeypatch.setattr(nsa_backend.routing, "detect_arch", lambda device=None: arch)
    monkeypatch.setattr(nsa_indexer, "_mode", "auto")
    served, _ = config.deep_gemm_serves_indexer(arch, heads, 128, 64)
    assert nsa_indexer.enabled_for_current_device(heads, 128, 64) == (not served)
    if arch in ("sm89", "sm80"):
        assert nsa_indexer.enabled_for_current_device(heads, 128, 64)


def test_settings_from_config_file_and_environment(tmp_path, monkeypatch):
    config = tmp_path / "nsa.toml"
    config.write_text('[vllm]\ntakeover = ["FLASHMLA_SPARSE"]\nindexer = "on"\nhc_prenorm = "off"\n')
    monkeypatch.setenv("NSA_BACKEND_CONFIG", str(config))
    monkeypatch.delenv("NSA_BACKEND_VLLM_TAKEOVER", raising=False)
    assert load_settings() == VllmSettings(takeover=("FLASHMLA_SPARSE",), indexer="on", hc_prenorm="off")
    monkeypatch.setenv("NSA_BACKEND_VLLM_TAKEOVER", "auto")
    assert load_settings().takeover == "auto"
    monkeypatch.setenv("NSA_BACKEND_VLLM_TAKEOVER", "FLASHATTN")
    with pytest.raises(ValueError, match="FLASHINFER_MLA_SPARSE_SM120"):
        load_settings()
