"""vLLM code that keys behaviour on the attention backend's name, run with nsa-backend's backends.

Our backend is registered as ``CUSTOM`` and, under ``takeover``, as ``FLASHMLA_SPARSE`` /
``FLASHINFER_MLA_SPARSE_SM120``; vLLM treats those names specially in a few places: the fp8 ->
fp8_ds_mla rewrite, the flat bf16 cache check and the JIT / autotune warm-ups. Each test calls vLLM's
own code with our backend classes and checks that the result is one our backend serves, or that the
configuration is refused at start-up by the backend's ``validate_configuration``. DeepSeek-V4's own
choice of attention class is tested in ``test_vllm_v4_select.py``.
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

