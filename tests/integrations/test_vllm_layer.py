"""vLLM's own DeepSeek-V3.2 attention layer (``vllm.models.deepseek_v32.attention.DeepseekV32Attention``,
with its ``SparseAttnIndexer`` and MLA attention wrapper) serving prefill, decode, MTP-verify and
mixed batches on the CPU with nsa-backend as its attention backend and indexer.

nsa-backend is registered the way vLLM loads it: vLLM's general-plugin loader runs the
``nsa_backend`` entry point (``plugin.register``) with ``NSA_BACKEND_VLLM_TAKEOVER=FLASHMLA_SPARSE``
and ``NSA_BACKEND_VLLM_INDEXER=on``. The layer then gets its backend class by name, as
``--attention-backend`` resolves it: ``CUSTOM`` (fp8_ds_mla cache) and, under takeover,
``FLASHMLA_SPARSE`` (cache ``fp8``, which vLLM's layer canonicalises to fp8_ds_mla for that name).
The metadata comes from the builders the layers name (nsa-backend's sparse-MLA builder, vLLM's
indexer builder) fed with vLLM's ``CommonAttentionMetadata``; each cache group has its own block
table. Everything else is vLLM's code: the fused norm / RoPE / cache-write and query kernels (Triton,
run by the CPU interpreter), the indexer call with the keywords of the installed release, the
W_UK / W_UV absorption and the projections.

Reference (``vllm_layer_support.reference_step``): the layer recomputed from its weights in float32
(RMSNorm, LayerNorm, YaRN RoPE, absorbed MLA, e4m3 quantisation with power-of-two scales, ReLU
index logits, top-k, sparse softmax, W_UV, o_proj). The top-k rows the indexer wrote must be top-k
sets of the reference logits (any order, near-ties either way); attention is then compared over
the chosen set. Requests shorter than ``index_topk`` (64) must select every visible key.

Tolerance: the reference quantises the latent cache and the index keys exactly as vLLM's writer
does (checked bit for bit by ``test_caches_hold_vllm_formats``), so what remains is bf16 rounding of
intermediates inside the attention kernels: outputs must agree within 1.5% of the output's largest
magnitude (plus 2% relative); measured differences are below 0.3%.

Replaced for the CPU (each with its torch equivalent, only inside these tests' fixtures):

- ``vllm.v1.attention.backends.mla.indexer.num_compute_units``: vLLM's platform query raises
  without a CUDA device; replaced by a constant (8 workers) for the indexer builder's schedule.
- ``triton.runtime.interpreter._convert_float`` for float32 -> e4m3 and float32 -> bf16: the Triton
  CPU interpreter drops the carry of a rounded-up mantissa (1.95 becomes 1.0 in e4m3) and truncates
  to bf16; replaced by torch's round-to-nearest-even conversion, what the GPU instructions do.
  Other conversions keep the interpreter's code.

vLLM's own sparse-MLA backends and DeepGEMM are CUDA-only, hence the plain-torch reference. vLLM
keeps Triton on a machine without a GPU driver only when ``CUDA_VISIBLE_DEVICES`` is set (empty)
before it is first imported; otherwise these tests fail saying so.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integrations import vllm_fixtures as vf  # noqa: E402
from tests.integrations import vllm_layer_support as ls  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs vLLM's Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, no CUDA device)",
)

# Requests: A crosses a block boundary and outgrows index_topk (64) during the prefill, so its later
# tokens have keys dropped; B stays below index_topk, so every visible key must be selected.
SCENARIO = {
    "prefill": ("plain", [("A", 68), ("B", 6)]),
    "decode": ("plain", [("A", 1), ("B", 1)]),
    "mtp_verify": ("mtp", [("A", 2), ("B", 2)]),  # next_n = 2: the target token plus one draft
    "mixed": ("plain", [("B", 1), ("A", 5)]),  # a decode and a chunked prefill in one batch
}
REGISTRATIONS = {
    # name -> (AttentionBackendEnum member the layer is given, cache dtype asked for, dtype it ends with)
    "custom": ("CUSTOM", "fp8_ds_mla", "fp8_ds_mla"),
    "takeover": ("FLASHMLA_SPARSE", "fp8", "fp8_ds_mla"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3.2 model's directory (its ``config.json``)."""
    return vf.model_dir(tmp_path_factory, "dsv32-layer", ls.LAYER_CONFIG)


@pytest.fixture(scope="module")
def vllm_on_cpu(model_dir):
    """nsa-backend registered through vLLM's plugin loader, TP = 1 over gloo, the CPU replacements
    listed in the module docstring; everything restored afterwards."""
    import triton.runtime.interpreter as triton_interpreter
    import vllm.plugins
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.mla import indexer as indexer_builder_module

    from nsa_backend_integrations.vllm import indexer as nsa_indexer
    from nsa_backend_integrations.vllm import plugin

    if not HAS_TRITON:
        pytest.fail(
            "vLLM was imported with its Triton placeholders (no active GPU driver); set "
            "CUDA_VISIBLE_DEVICES='' before vLLM is first imported so that it keeps Triton"
        )
    vf.cpu_platform()
    saved_overrides = dict(registry._ATTN_OVERRIDES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NSA_BACKEND_VLLM_TAKEOVER", "FLASHMLA_SPARSE")
        mp.setenv("NSA_BACKEND_VLLM_INDEXER", "on")
        mp.setenv("NSA_BACKEND_VLLM_HC_PRENORM", "off")
        mp.delenv("NSA_BACKEND_CONFIG", raising=False)
        # A fresh registration state, so that the entry point registers again with these settings.
        mp.setattr(plugin, "_state", {"registered": False, "calls": 0, "errors": {}})
        mp.setattr(nsa_indexer, "_mode", nsa_indexer._mode)
        mp.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()
        state = plugin.registration_state()
        assert state["errors"] == {} and state["takeover"] == ("FLASHMLA_SPARSE",), state
        mp.setattr(indexer_builder_module, "num_compute_units", lambda device_id=0: 8)
        mp.setattr(
            triton_interpreter,
            "_convert_float",
            ls.rounding_float_conversion(triton_interpreter._convert_float),
        )
        own_distributed = not model_parallel_is_initialized()
        if own_distributed:
            with set_current_vllm_config(ls.make_vllm_config(model_dir, "fp8_ds_mla")):
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{vf.free_port()}",
                )
                initialize_model_parallel(1, 1)
        try:
            yield state
        finally:
            if own_distributed:
                destroy_model_parallel()
                destroy_distributed_environment()
            registry._ATTN_OVERRIDES.clear()
            registry._ATTN_OVERRIDES.update(saved_overrides)


class Scenario:
    """The steps of :data:`SCENARIO` served in order by one layer; each step runs once, on demand."""

    def __init__(self, registration: str, model_dir: str):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        member, cache_dtype, self.kv_format = REGISTRATIONS[registration]
        # What vLLM's selector returns for ``--attention-backend <member>``.
        self.backend = AttentionBackendEnum[member].get_class()
        # Served under an MTP config (one draft token); plain steps use builders made from the same
        # model's config without speculative decoding.
        config = ls.make_vllm_config(model_dir, cache_dtype, num_speculative_tokens=1)
        self.engine = ls.LayerEngine(config, self.backend)
        self.engine.add_builders("plain", ls.make_vllm_config(model_dir, cache_dtype))
        self.requests = {"A": self.engine.add_request(num_blocks=2), "B": self.engine.add_request(num_blocks=1)}
        self.steps: dict[str, ls.Step] = {}
        self.references: dict[str, torch.Tensor | BaseException] = {}
        self.failed: BaseException | None = None

    def result(self, name: str) -> tuple[ls.Step, torch.Tensor]:
        """The layer's step ``name`` (running the steps before it first) and its reference output.

        A forward that raises fails this step and every later one (the caches are then unknown); a
        reference check that fails (the indexer's top-k) fails only its own step.
        """
        for step_name, (builders, schedule) in SCENARIO.items():
            if step_name not in self.steps:
                if self.failed is not None:
                    raise RuntimeError(f"an earlier step failed: {self.failed!r}") from self.failed
                try:
                    step = self.engine.step([(self.requests[r], n) for r, n in schedule], builders)
                except BaseException as exc:
                    self.failed = exc
                    raise
                self.steps[step_name] = step
                try:
                    self.references[step_name] = ls.reference_step(self.engine, step, self.kv_format)
                except AssertionError as exc:
                    self.references[step_name] = exc
            if step_name == name:
                reference = self.references[name]
                if isinstance(reference, BaseException):
                    raise reference
                return self.steps[name], reference
        raise KeyError(name)


@pytest.fixture(scope="module", params=list(REGISTRATIONS))
def scenario(request, vllm_on_cpu, model_dir):
    return Scenario(request.param, model_dir)


def _check_output(step: ls.Step, reference: torch.Tensor, where: str) -> None:
    out = step.output.float()
    assert out.shape == reference.shape, where
    atol = 0.015 * float(reference.abs().max())
    torch.testing.assert_close(out, reference, atol=atol, rtol=0.02, msg=lambda m: f"{where}: {m}")


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_layer_is_built_on_nsa_backend(scenario):
    from nsa_backend_integrations.vllm.backend import NsaSparseMLABackend, NsaSparseMLAImpl
    from nsa_backend_integrations.vllm.indexer import NsaSparseAttnIndexer, nsa_sparse_attn_indexer

    layer = scenario.engine.layer
    # The layer calls the indexer function by its module-level name, with the release's keywords.
    v32 = sys.modules["vllm.models.deepseek_v32.attention"]
    assert inspect.unwrap(v32.sparse_attn_indexer) is nsa_sparse_attn_indexer
    assert issubclass(scenario.backend, NsaSparseMLABackend)
    assert layer.attn_backend is scenario.backend
    assert type(layer.impl) is NsaSparseMLAImpl
    assert type(layer.indexer.indexer_op) is NsaSparseAttnIndexer and layer.indexer.indexer_op.nsa_enabled
    # Under FLASHMLA_SPARSE vLLM turns the fp8 cache into fp8_ds_mla by the backend's name.
    assert layer.kv_cache_dtype == scenario.kv_format == layer.impl.kv_cache_dtype
    assert scenario.engine.mla_cache.shape[-1] == 656


@pytest.mark.parametrize("step_name", list(SCENARIO))
def test_layer_matches_reference(scenario, step_name):
    step, reference = scenario.result(step_name)
    _check_output(step, reference, f"{scenario.backend.get_name()} {step_name}")


def test_prefill_drops_keys_only_past_topk(scenario):
    """The prefill batch exercises both regimes: all keys (position < 64) and a real top-k."""
    step, _ = scenario.result("prefill")
    topk = scenario.engine.hf_config.index_topk
    past_topk = 0
    for t, p in enumerate(step.token_position):
        picked = step.topk[t][step.topk[t] >= 0]
        if p + 1 <= topk:
            assert sorted(picked.tolist()) == list(range(p + 1)), f"token {t} at position {p}"
        else:
            past_topk += 1
            assert picked.numel() == topk and int(picked.max()) <= p, f"token {t} at position {p}"
    assert past_topk > 0


def test_caches_hold_vllm_formats(scenario):
    """vLLM's writer filled both caches with what the reference assumes (bit for bit after decoding)."""
    scenario.result("prefill")
    engine = scenario.engine
    for r in scenario.requests.values():
        expected = ls.request_tensors(engine, r, scenario.kv_format)
        latent, k_rope, index_k = ls.read_caches(engine, r)
        assert torch.equal(latent, expected.latent), f"request {r}: latent cache"
        assert torch.equal(k_rope, expected.k_rope), f"request {r}: rope cache"
        assert torch.equal(index_k, expected.index_k), f"request {r}: indexer cache"
