"""vLLM code that keys behaviour on the attention backend's name, run with nsa-backend's backends.

Our backend is registered as ``CUSTOM`` and, under ``takeover``, as ``FLASHMLA_SPARSE`` /
``FLASHINFER_MLA_SPARSE_SM120``; vLLM treats those names specially in a few places: the fp8 ->
fp8_ds_mla rewrite, the flat bf16 cache check, the JIT / autotune warm-ups and DeepSeek-V4's own
choice of attention class. Each test calls vLLM's own code with our backend classes and checks that
the result is one our backend serves, or that the configuration is refused at start-up (by the
backend's ``validate_configuration``, or for DeepSeek-V4 by the plugin's config hook).
"""

from __future__ import annotations

import types

import pytest

vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers.attention import mla_attention  # noqa: E402

from nsa_backend_integrations.vllm import backend as nb  # noqa: E402

BACKENDS = [nb.NsaSparseMLABackend, nb.FlashMLASparseTakeoverBackend, nb.FlashInferSM120TakeoverBackend]
KV_CACHE_DTYPES = ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla"]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.get_name())
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_canonicalised_kv_cache_dtype_is_served_or_refused(backend, kv_cache_dtype):
    """``_canonicalize_sparse_mla_kv_cache_dtype`` rewrites the cache dtype by backend name (fp8 ->
    fp8_ds_mla for the takeover names only). A dtype the backend accepts at start-up becomes a
    format the impl serves, and the backend's own view of the rewrite matches vLLM's."""
    canonical = mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, kv_cache_dtype)
    if not backend.supports_kv_cache_dtype(kv_cache_dtype):
        # Refused by vLLM's selector with its reason before any layer is built.
        assert backend.get_name() in ("CUSTOM", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
        assert kv_cache_dtype not in backend.supported_kv_cache_dtypes
        return
    assert nb._kv_format(canonical) in ("bf16", "fp8_ds_mla")
    assert backend._canonical_kv_cache_dtype(kv_cache_dtype) == canonical


def test_custom_refuses_plain_fp8_at_startup():
    """Under ``CUSTOM`` vLLM does not rewrite ``fp8``; the backend refuses it (no silent bf16)."""
    assert mla_attention._canonicalize_sparse_mla_kv_cache_dtype(nb.NsaSparseMLABackend, "fp8") == "fp8"
    assert not nb.NsaSparseMLABackend.supports_kv_cache_dtype("fp8")


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.get_name())
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_ds_mla"])
def test_flat_cache_check_and_jit_warmup_hold_for_our_layout(backend, kv_cache_dtype):
    """``MLAAttention._uses_flat_kv_cache`` (name-keyed) decides whether ``bind_kv_cache`` warms up
    vLLM's slot-conversion kernel, which asserts that blocks lie a whole number of rows apart. Where
    vLLM calls our cache flat, our ``customize_spec`` makes the block stride a multiple of the row."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    canonical = mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, kv_cache_dtype)
    layer = types.SimpleNamespace(attn_backend=backend, kv_cache_dtype=canonical)
    flat = mla_attention.MLAAttention._uses_flat_kv_cache(layer)
    # vLLM calls a bf16 cache flat only under FLASHMLA_SPARSE; ds_mla rows are never flat.
    assert flat == (backend.get_name() == "FLASHMLA_SPARSE" and canonical not in ("fp8_ds_mla",))
    if not flat:
        return
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str=canonical)
    aligned = backend.customize_spec(spec)
    row_bytes = 576 * 2
    assert aligned.get_block_stride_alignment() % row_bytes == 0


@pytest.fixture(scope="module")
def dsa_model(tmp_path_factory):
    from tests.integrations import vllm_fixtures as vf

    vf.cpu_platform()
    return vf.model_dir(tmp_path_factory, "dsa", vf.DSA_CONFIG)


# vLLM modules whose kernels a JIT warm-up may compile for a layer served by nsa-backend: the indexer
# builder's, the compressor's and the sparse-SWA metadata kernels, and the flat-cache index converter.
# None of them is a FlashMLA / FlashInfer attention kernel; all run on the metadata / caches vLLM
# builds, as with vLLM's own backends.
VLLM_METADATA_KERNEL_MODULES = {
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.attention.backends.mla.compressor_utils",
    "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.v1.attention.backends.mla.sparse_utils",
}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.get_name())
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla"])
def test_jit_warmup_registered_for_our_layers(dsa_model, backend, kv_cache_dtype):
    """vLLM's real ``MLAAttention.__init__`` and ``bind_kv_cache`` with ``enable_jit_warmup``, inside
    the JIT warm-up registry the model runner activates: what they register for a layer served by
    nsa-backend (by name and under takeover) is vLLM's metadata kernels only, never an attention
    kernel, and the registrations expand to compile keys as the runner's warm-up does first. The
    compile itself is Triton on a GPU and is not run here. ``CUSTOM`` registers nothing (vLLM's list
    keys on its own names): those kernels then compile at their first call."""
    import inspect

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tests.integrations import vllm_fixtures as vf

    config = vf.vllm_config(dsa_model)
    config.cache_config.cache_dtype = kv_cache_dtype
    config.kernel_config.enable_jit_warmup = True
    registry = JitWarmupRegistry(config)
    prefix = f"model.layers.{BACKENDS.index(backend)}{KV_CACHE_DTYPES.index(kv_cache_dtype)}.self_attn.attn"
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16), registry.activate():
        layer = MLAAttention(
            num_heads=4, scale=0.1, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=128,
            kv_lora_rank=512, kv_b_proj=torch.nn.Linear(512, 4 * 256, bias=False), cache_config=config.cache_config,
            prefix=prefix, attn_backend=backend, use_sparse=True,
        )
        assert isinstance(layer.impl, nb.NsaSparseMLAImpl)
        # The cache as vLLM's runner lays it out from the layer's spec (one block stride per spec).
        spec = backend.customize_spec(layer.get_kv_cache_spec(config))
        row_bytes = spec.page_size_bytes // spec.block_size
        layer.bind_kv_cache(torch.zeros(4, 1, spec.block_size, row_bytes, dtype=torch.uint8).view(spec.dtype))
    registered = {type(kernel).__module__: regs for kernel, regs in registry._registrations.items()}
    if backend.get_name() == "CUSTOM":
        assert not registered
        return
    assert registered and set(registered) <= VLLM_METADATA_KERNEL_MODULES, sorted(registered)
    # The flat-cache converter is registered exactly where vLLM reads our cache as flat rows.
    flat = "vllm.v1.attention.backends.mla.sparse_utils" in registered
    assert flat == MLAAttention._uses_flat_kv_cache(layer)
    # The runner's first warm-up step: expanding each registration to compile keys (some expand to
    # none for a DeepSeek-V3.2 layer, e.g. the compressor's); it must not raise for our layers. The
    # flat-cache converter's expansion evaluates Triton helpers (GPU only): its registration is
    # checked instead, block stride in whole rows as vLLM's bind_kv_cache asserts.
    for kernel, regs in registry._registrations.items():
        for args, kwargs in regs:
            if type(kernel).__module__.endswith("sparse_utils"):
                assert kwargs["block_stride_rows"] * layer.kv_cache.shape[-1] == layer.kv_cache.stride(0)
                continue
            if not args and not kwargs and "vllm_config" in inspect.signature(kernel.get_warmup_keys).parameters:
                kwargs = {"vllm_config": config}
            list(kernel.get_warmup_keys(*args, **kwargs))


def test_flashinfer_autotune_warmup_decisions_for_our_names():
    """vLLM's FlashInfer sparse-MLA warm-up picks layers by backend name: under the SM120 takeover
    name ours get its decode autotune pass, which is a model dummy run (through nsa-backend's impl)
    inside FlashInfer's autotuner context, harmless to kernels that never consult it; no name of ours
    gets the DeepSeek-V4 warm-up."""
    from vllm.model_executor.warmup import flashinfer_sparse_mla_warmup as fw

    for backend in BACKENDS:
        runner = types.SimpleNamespace(attn_groups=[[types.SimpleNamespace(backend=backend)]])
        label = fw._flashinfer_sparse_mla_decode_label(runner, fw._FLASHINFER_MLA_SPARSE_BACKENDS)
        assert label == ("DSv3.2" if backend.get_name() == "FLASHINFER_MLA_SPARSE_SM120" else None)
        assert not fw._has_deepseek_v4_sparse_mla_backend(runner)


# --- DeepSeek-V4 ----------------------------------------------------------------------------------
# vLLM builds DeepSeek-V4 attention from its own classes (``_select_dsv4_attn_cls``: by GPU arch, or
# by a *_DSV4 name), never from CUSTOM or the takeover names, and nsa-backend has no DeepSeek-V4 op:
# a request for nsa-backend is refused by the model's config hook, before any worker starts.

DSV4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 576,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "index_topk": 512,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "intermediate_size": 512,
}
MODEL_CONFIGS = "vllm.model_executor.models.config"


@pytest.fixture(scope="module")
def dsv4_model(tmp_path_factory):
    from tests.integrations import vllm_fixtures as vf

    vf.cpu_platform()
    return vf.model_dir(tmp_path_factory, "dsv4", DSV4_CONFIG)


@pytest.fixture
def backends(monkeypatch):
    """nsa-backend registered through its plugin, on a copy of vLLM's backend overrides (restored
    after the test): CUSTOM is nsa-backend's, no name is taken over until a test registers one."""
    from vllm.v1.attention.backends import registry

    from nsa_backend_integrations.vllm import plugin

    plugin.register()
    overrides = {k: v for k, v in registry._ATTN_OVERRIDES.items() if k.name not in plugin.TAKEOVER_BACKEND_PATHS}
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", overrides)
    assert "DeepseekV4ForCausalLM" in plugin.registration_state()["deepseek_v4_refusal"]
    return plugin


@pytest.fixture
def vllm_dsv4_hook(monkeypatch):
    """Calls of vLLM's own DeepSeek-V4 config hook (the one the refusal wraps), recorded; vLLM's
    hook still runs."""
    import importlib

    original = importlib.import_module(MODEL_CONFIGS).MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"].nsa_backend_original
    vllm_hook = original.verify_and_update_config
    calls = []

    def recording(vllm_config):
        calls.append(vllm_config)
        vllm_hook(vllm_config)

    monkeypatch.setattr(original, "verify_and_update_config", staticmethod(recording))
    return calls


def _take_over(plugin, name: str) -> None:
    from nsa_backend_integrations.vllm.config import VllmSettings

    assert plugin._register_backends(VllmSettings(takeover=(name,)), None) == (name,)


def _dsv4_vllm_config(model: str, backend: str | None):
    """``VllmConfig`` of the DeepSeek-V4 model on the CPU with ``--attention-backend backend``;
    building it runs vLLM's config hooks."""
    from vllm.config import AttentionConfig, DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                      attention_config=AttentionConfig(backend=backend))


def _rerun_config_hooks(config, backend: str | None) -> None:
    """Run vLLM's ``VllmConfig.try_verify_and_update_config`` again with ``--attention-backend
    backend``, from a state where the DeepSeek-V4 hook has not run yet."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config.attention_config.backend = None if backend is None else AttentionBackendEnum[backend]
    config.model_config.config_updated = False
    config.try_verify_and_update_config()


def test_dsv4_with_custom_is_refused_at_startup(dsv4_model, backends, vllm_dsv4_hook):
    """``--attention-backend CUSTOM`` with DeepSeek-V4: building vLLM's config fails, naming the flag
    and how to run the model on vLLM's own attention."""
    with pytest.raises(ValueError, match="cannot serve DeepseekV4ForCausalLM") as refused:
        _dsv4_vllm_config(dsv4_model, "CUSTOM")
    assert not vllm_dsv4_hook
    message = str(refused.value)
    assert "asked for by --attention-backend CUSTOM" in message
    assert "drop --attention-backend CUSTOM" in message and "SM8x" in message


@pytest.mark.parametrize("name", ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120"])
def test_dsv4_with_a_takeover_name_named_is_refused_at_startup(dsv4_model, backends, vllm_dsv4_hook, name):
    """``--attention-backend NAME`` for a takeover name served by nsa-backend: refused, naming the
    flag, the setting, its variable and the way out."""
    config = _dsv4_vllm_config(dsv4_model, None)
    _take_over(backends, name)
    with pytest.raises(ValueError, match="cannot serve DeepseekV4ForCausalLM") as refused:
        _rerun_config_hooks(config, name)
    assert len(vllm_dsv4_hook) == 1  # building the config ran it; the refused run did not
    message = str(refused.value)
    assert f"--attention-backend {name} with the nsa-backend [vllm] takeover setting" in message
    assert f"(config file or NSA_BACKEND_VLLM_TAKEOVER), which serves {name}" in message
    assert 'set takeover = "off"' in message and "NSA_BACKEND_VLLM_TAKEOVER=off" in message


@pytest.mark.parametrize("name", ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120"])
def test_dsv4_under_standing_takeover_runs_vllms_hook(dsv4_model, backends, vllm_dsv4_hook, name):
    """Takeover on (as the Docker image's ``auto``) and no backend named: a DeepSeek-V4 model runs
    on vLLM's own attention, as it would without nsa-backend (takeover replaces DeepSeek-V3.2
    backend names, which DeepSeek-V4 never looks up)."""
    config = _dsv4_vllm_config(dsv4_model, None)
    _take_over(backends, name)
    _rerun_config_hooks(config, None)
    assert vllm_dsv4_hook == [config, config]


@pytest.mark.parametrize(("takeover", "backend"), [
    (None, None),                            # nsa-backend installed, not asked for
    (None, "FLASHMLA_SPARSE_DSV4"),          # vLLM's DeepSeek-V4 backend by name
    ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4"),  # takeover on, but vLLM's DeepSeek-V4 backend named
    ("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_DSV4"),
])
def test_dsv4_without_our_backend_runs_vllms_hook(dsv4_model, backends, vllm_dsv4_hook, takeover, backend):
    """Not asked for nsa-backend: vLLM's own DeepSeek-V4 hook runs, on building the config and again."""
    config = _dsv4_vllm_config(dsv4_model, backend)
    if takeover is not None:
        _take_over(backends, takeover)
    _rerun_config_hooks(config, backend)
    assert vllm_dsv4_hook == [config, config]


def test_dsv4_custom_of_another_plugin_is_left_alone(dsv4_model, backends, vllm_dsv4_hook, monkeypatch):
    """CUSTOM registered to another class is not a request for nsa-backend."""
    from vllm.v1.attention.backends import registry

    config = _dsv4_vllm_config(dsv4_model, None)
    monkeypatch.setitem(registry._ATTN_OVERRIDES, registry.AttentionBackendEnum.CUSTOM, "other.plugin.Backend")
    _rerun_config_hooks(config, "CUSTOM")
    assert vllm_dsv4_hook == [config, config]


def test_dsv4_attention_selection_is_vllms_own(dsv4_model, backends, monkeypatch):
    """vLLM's real ``_select_dsv4_attn_cls`` stays vLLM's and picks its own classes by GPU arch
    with nsa-backend registered. It would also pick them for CUSTOM (it never reads it), which is
    why that request is refused at start-up instead."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    try:
        from vllm.models.deepseek_v4.nvidia import model as dsv4
    except ImportError as exc:  # the module imports CUDA-side helpers; all import on CPU in 0.33 / 0.34
        pytest.fail(f"vLLM's DeepSeek-V4 NVIDIA model does not import: {exc}")
    assert dsv4._select_dsv4_attn_cls.__module__ == dsv4.__name__
    config = _dsv4_vllm_config(dsv4_model, None)
    expected = {(9, 0): dsv4.DeepseekV4FlashMLAAttention, (10, 0): dsv4.DeepseekV4FlashMLAAttention,
                (12, 0): dsv4.DeepseekV4FlashInferSM120Attention}
    for (major, minor), cls in expected.items():
        monkeypatch.setattr(current_platform, "get_device_capability",
                            lambda device_id=0, m=major, n=minor: DeviceCapability(m, n))
        assert dsv4._select_dsv4_attn_cls(config) is cls
        config.attention_config.backend = registry_member("CUSTOM")
        assert dsv4._select_dsv4_attn_cls(config) is cls
        config.attention_config.backend = None


def registry_member(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def test_dsv4_refusal_covers_vllms_dsv4_models_and_its_call_sites_bind(backends):
    """Every DeepSeek-V4 model vLLM registers (drafts aside: they run under a main model's config)
    gets the refusing hook, and every call vLLM makes of a config hook binds to it."""
    import importlib
    import inspect
    import re

    from vllm.model_executor.models import registry as model_registry

    from tests.integrations.test_vllm_contracts import assert_sites_bind, call_sites_of_method, files_importing

    config_map = importlib.import_module(MODEL_CONFIGS).MODELS_CONFIG_MAP
    models = {**model_registry._TEXT_GENERATION_MODELS, **model_registry._MULTIMODAL_MODELS}
    dsv4 = sorted(arch for arch, (module, _) in models.items() if module.startswith("vllm.models.deepseek_v4"))
    assert "DeepseekV4ForCausalLM" in dsv4
    refused = backends.registration_state()["deepseek_v4_refusal"]
    assert set(dsv4) <= set(refused), f"DeepSeek-V4 models without the refusal: {sorted(set(dsv4) - set(refused))}"
    assert all(getattr(config_map[arch], "nsa_backend_original", None) for arch in refused)
    hook = config_map["DeepseekV4ForCausalLM"].verify_and_update_config
    sites = call_sites_of_method("verify_and_update_config", re.compile(r"^cls$"),
                                 files_importing(MODEL_CONFIGS, "MODELS_CONFIG_MAP"))
    assert sites, "vLLM no longer calls the config hooks it looks up in MODELS_CONFIG_MAP"
    assert_sites_bind(inspect.signature(hook), sites, "MODELS_CONFIG_MAP[...].verify_and_update_config")
