"""Contract tests between nsa-backend's DeepSeek-V4 attention (``integrations/vllm/dsv4.py``) and the
installed vLLM's own source.

What the integration replaces or wraps for DeepSeek-V4, and what is checked for each:

- ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls`` (wrapped): every call in vLLM that
  reaches the module attribute binds to the wrapper's signature, no vLLM module binds the name at
  import time (it would not see the wrapper), and the wrapper keeps vLLM's signature.
- the methods :class:`NsaDeepseekV4Attention` overrides on vLLM's ``DeepseekV4Attention``
  (``forward_mqa``, ``_fused_qnorm_rope_kv_insert``, ``_o_proj``, ``get_padded_num_q_heads``) and
  the one :class:`NsaSparseSWAMetadataBuilder` overrides (``build_tile_scheduler``): every
  ``self.<method>(...)`` / ``<builder>.<method>(...)`` call in vLLM binds to our signature, and
  ours accepts every call vLLM's accepts.
- the attention class keeps vLLM's constructor (no ``__init__`` of its own), so every constructor call
  site (``_select_dsv4_attn_cls(vllm_config)(vllm_config, prefix=..., ...)``) binds as it does for
  vLLM's classes.

They run in whichever vLLM is installed (0.33 and 0.34 both carry DeepSeek-V4).
"""

from __future__ import annotations

import inspect
import re

import pytest

vllm = pytest.importorskip("vllm")

from tests.integrations.test_vllm_contracts import (  # noqa: E402
    assert_sites_bind,
    call_sites_of_method,
    call_sites_of_module_attribute,
    calls_accepted_by,
    module_level_imports,
    superset_failures,
)

MODEL = "vllm.models.deepseek_v4.nvidia.model"
SELECTOR = "_select_dsv4_attn_cls"


@pytest.fixture(scope="module")
def dsv4():
    from nsa_backend_integrations.vllm import dsv4

    return dsv4


@pytest.fixture
def installed(dsv4, monkeypatch):
    """The selector wrapped by ``dsv4.install`` (vLLM's own restored afterwards)."""
    import importlib

    module = importlib.import_module(MODEL)
    monkeypatch.setattr(module, SELECTOR, getattr(module, SELECTOR))
    dsv4.install(None, lambda: None)
    return module


def test_vllm_has_deepseek_v4():
    """Both supported releases (0.33.0, 0.34.0) ship the DeepSeek-V4 NVIDIA model with the selector."""
    import importlib

    module = importlib.import_module(MODEL)
    assert callable(getattr(module, SELECTOR, None)), f"{MODEL} has no {SELECTOR}"


def test_selector_is_wrapped_and_keeps_the_original(installed, dsv4):
    wrapper = getattr(installed, SELECTOR)
    assert wrapper.__module__ == dsv4.__name__ or wrapper.__wrapped__.__module__ == MODEL
    original = wrapper.nsa_backend_original
    assert original.__module__ == MODEL and original.__name__ == SELECTOR
    dsv4.install(None, lambda: None)   # idempotent: the original is not wrapped twice
    assert getattr(installed, SELECTOR).nsa_backend_original is original


def test_every_selector_call_site_binds(installed):
    """Every call of the selector in vLLM looks it up at call time and binds to the wrapper."""
    wrapper = getattr(installed, SELECTOR)
    sites = call_sites_of_module_attribute(MODEL, SELECTOR)
    assert sites, f"vLLM no longer calls {MODEL}.{SELECTOR}"
    assert_sites_bind(inspect.signature(wrapper), sites, f"{MODEL}.{SELECTOR}")
    early = module_level_imports(MODEL, SELECTOR)
    assert not early, f"modules binding {SELECTOR} at import time (they miss the wrapper): {early}"


def test_selector_signature_is_vllms(installed):
    wrapper = getattr(installed, SELECTOR)
    problems = superset_failures(inspect.signature(wrapper), inspect.signature(wrapper.nsa_backend_original))
    assert not problems, problems


def _unbound(fn) -> inspect.Signature:
    """``fn``'s signature as a call through an instance or class sees it (``self`` / ``cls`` dropped)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return signature.replace(parameters=params)


# vLLM modules whose ``self.<method>(...)`` calls run on a DeepseekV4Attention built by the NVIDIA
# selector (the CPU / ROCm / XPU subclasses and DeepSeek-V4.1 have their own classes).
_SHARED_V4 = ("vllm/models/deepseek_v4/attention.py", "vllm/models/deepseek_v4/nvidia/")

OVERRIDES = ("forward_mqa", "_fused_qnorm_rope_kv_insert", "_o_proj", "get_padded_num_q_heads")


@pytest.mark.parametrize("name", OVERRIDES)
def test_attention_overrides_bind_vllms_calls(dsv4, name):
    """``self.<name>(...)`` calls in vLLM's DeepSeek-V4 code reach our override: they bind to it,
    and it accepts every call vLLM's base method accepts."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    ours = _unbound(getattr(dsv4.NsaDeepseekV4Attention, name))
    theirs = _unbound(getattr(DeepseekV4Attention, name))
    assert getattr(dsv4.NsaDeepseekV4Attention, name) is not getattr(DeepseekV4Attention, name)
    assert not calls_accepted_by(ours, theirs), calls_accepted_by(ours, theirs)
    sites = [s for s in call_sites_of_method(name, re.compile(r"^(self|cls)$")) if s.where.startswith(_SHARED_V4)]
    assert sites, f"vLLM's DeepSeek-V4 code no longer calls self.{name}"
    assert_sites_bind(ours, sites, f"NsaDeepseekV4Attention.{name}")


def test_attention_keeps_vllms_constructor_and_cache_machinery(dsv4):
    """No constructor of our own: vLLM's builds the projections, compressor, indexer and SWA cache."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend

    cls = dsv4.NsaDeepseekV4Attention
    assert issubclass(cls, DeepseekV4Attention) and "__init__" not in vars(cls)
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
    assert cls.backend_cls is DeepseekV4FlashMLABackend
    for method in ("bind_kv_cache", "get_kv_cache_spec", "forward", "_prepare_and_attn", "_sparse_indexer_and_attn"):
        assert getattr(cls, method) is getattr(DeepseekV4Attention, method), method


def test_swa_builder_override_binds_vllms_calls(dsv4):
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadataBuilder

    builder = dsv4.NsaSparseSWABackend.get_builder_cls()
    assert issubclass(builder, DeepseekSparseSWAMetadataBuilder)
    ours = _unbound(builder.build_tile_scheduler)
    theirs = _unbound(DeepseekSparseSWAMetadataBuilder.build_tile_scheduler)
    assert not superset_failures(ours, theirs), superset_failures(ours, theirs)
    sites = call_sites_of_method("build_tile_scheduler", re.compile(r"^self$"))
    assert sites, "vLLM no longer calls self.build_tile_scheduler"
    assert_sites_bind(ours, sites, "NsaSparseSWAMetadataBuilder.build_tile_scheduler")
