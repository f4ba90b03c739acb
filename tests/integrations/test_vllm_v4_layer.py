"""vLLM's own DeepSeek-V4 attention layer (``vllm.models.deepseek_v4.attention.DeepseekV4Attention``,
its projections, SWA cache layer and SWA metadata builder) serving prefill, decode and mixed batches
on the CPU with nsa-backend's class, chosen by vLLM's wrapped ``_select_dsv4_attn_cls`` for
``--attention-backend CUSTOM`` and, with no backend named, under ``takeover = "auto"`` on a machine
whose GPU vLLM's kernels do not serve (here: none).

What runs is vLLM's code except the calls nsa-backend replaces: the fused q / kv RMSNorm and the
inverse RoPE of the output (vLLM's Triton kernels, in the CPU interpreter), the projections, the
SWA metadata builder (vLLM's, less FlashMLA's tile scheduler), then nsa-backend's KV-cache write
(``write_fp8_ds_mla_v4_cache``) and sparse attention (``sparse_mla_decode`` over the 584-byte
cache, with the sink) and the grouped ``wo_a``.

Exercised: sliding-window layers (``compress_ratio`` 1); C4A / C128A layers (vLLM's compressor and
indexer with their own caches and metadata) are ``test_vllm_v4_compressed.py``'s.

Replaced for the CPU: ``triton.runtime.interpreter._convert_float`` for float32 -> e4m3 / bf16 (the
interpreter drops the carry of a rounded-up mantissa), by torch's round-to-nearest-even conversion,
as ``test_vllm_layer.py`` does.

Reference (``vllm_v4_layer_support.reference_step``): the layer recomputed from its weights in
float32 (see that module). Tolerance: the cache is checked to hold the reference's quantised keys
exactly (``test_cache_holds_v4_rows``); what remains is bf16 rounding inside the kernels: outputs
must agree within 1.5% of the largest output magnitude (plus 2% relative).
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integrations import vllm_fixtures as vf  # noqa: E402
from tests.integrations import vllm_v4_layer_support as ls  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs vLLM's Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, no CUDA device)",
)

# Request A outgrows the window (8) and crosses no block; B is shorter than the window.
SCENARIO = {
    "prefill": [("A", 20), ("B", 5)],
    "decode": [("A", 1), ("B", 1)],
    "mixed": [("B", 1), ("A", 6)],   # a decode and a chunked prefill in one batch
}
SELECTIONS = {"custom": ("CUSTOM", "off"), "takeover": (None, "auto")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return vf.model_dir(tmp_path_factory, "dsv4-layer", ls.LAYER_CONFIG)


@pytest.fixture(scope="module")
def vllm_on_cpu(model_dir):
    """nsa-backend registered through its plugin, TP = 1 over gloo; vLLM's selector and backend
    overrides restored afterwards."""
    import importlib

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

    from nsa_backend_integrations.vllm import dsv4, plugin

    if not HAS_TRITON:
        pytest.fail("vLLM was imported with its Triton placeholders; set CUDA_VISIBLE_DEVICES='' before "
                    "vLLM is first imported so that it keeps Triton")
    vf.cpu_platform()
    model = importlib.import_module(dsv4.MODEL_MODULE)
    saved_selector = getattr(model, dsv4.SELECTOR)
    saved_overrides = dict(registry._ATTN_OVERRIDES)
    # A registration by an earlier module would make register() a no-op: start unregistered, restore after.
    saved_state = {**plugin._state, "errors": dict(plugin._state["errors"])}
    plugin._state["registered"] = False
    plugin.register()
    # The Triton interpreter's float32 -> e4m3 / bf16 conversions drop a rounded-up mantissa's carry;
    # torch's round-to-nearest-even is what the GPU instructions do (see vllm_layer_support).
    import triton.runtime.interpreter as triton_interpreter

    from tests.integrations.vllm_layer_support import rounding_float_conversion

    saved_convert = triton_interpreter._convert_float
    triton_interpreter._convert_float = rounding_float_conversion(saved_convert)
    own = not model_parallel_is_initialized()
    if own:
        with set_current_vllm_config(ls.make_vllm_config(model_dir)):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{vf.free_port()}")
            initialize_model_parallel(1, 1)
    try:
        yield plugin, dsv4
    finally:
        triton_interpreter._convert_float = saved_convert
        if own:
            destroy_model_parallel()
            destroy_distributed_environment()
        setattr(model, dsv4.SELECTOR, saved_selector)
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved_overrides)
        plugin._state.clear()
        plugin._state.update(saved_state)


class Scenario:
    """The steps of :data:`SCENARIO` served in order by one layer; each runs once, on demand."""

    def __init__(self, selection: str, model_dir: str, plugin, dsv4):
        from nsa_backend_integrations.vllm.config import load_settings

        backend, takeover = SELECTIONS[selection]
        dsv4.install(load_settings(overrides={"takeover": takeover}), lambda: None)
        self.engine = ls.LayerEngine(ls.make_vllm_config(model_dir, backend))
        self.requests = {"A": self.engine.add_request(num_blocks=1), "B": self.engine.add_request(num_blocks=1)}
        self.steps: dict[str, ls.Step] = {}
        self.failed: BaseException | None = None

    def result(self, name: str) -> tuple[ls.Step, torch.Tensor]:
        for step_name, schedule in SCENARIO.items():
            if step_name not in self.steps:
                if self.failed is not None:
                    raise RuntimeError(f"an earlier step failed: {self.failed!r}") from self.failed
                try:
                    self.steps[step_name] = self.engine.step([(self.requests[r], n) for r, n in schedule])
                except BaseException as exc:
                    self.failed = exc
                    raise
            if step_name == name:
                step = self.steps[name]
                return step, ls.reference_step(self.engine, step)
        raise KeyError(name)


@pytest.fixture(scope="module", params=list(SELECTIONS))
def scenario(request, vllm_on_cpu, model_dir):
    return Scenario(request.param, model_dir, *vllm_on_cpu)


def test_layer_is_nsa_backends(scenario):
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    from nsa_backend_integrations.vllm.dsv4 import NsaDeepseekV4Attention, NsaSparseSWAMetadataBuilder

    layer = scenario.engine.layer
    assert type(layer) is NsaDeepseekV4Attention and isinstance(layer, DeepseekV4Attention)
    assert layer.compress_ratio == 1 and layer.padded_heads == layer.n_local_heads
    assert type(scenario.engine.builder) is NsaSparseSWAMetadataBuilder
    assert layer.kv_cache_dtype == "fp8_ds_mla" and scenario.engine.spec.state_content_bytes == 584


@pytest.mark.parametrize("step_name", list(SCENARIO))
def test_layer_matches_reference(scenario, step_name):
    step, reference = scenario.result(step_name)
    out = step.output.float()
    assert out.shape == reference.shape
    atol = 0.015 * float(reference.abs().max())
    torch.testing.assert_close(out, reference, atol=atol, rtol=0.02, msg=lambda m: f"{step_name}: {m}")


def test_cache_holds_v4_rows(scenario):
    """nsa-backend's writer filled vLLM's SWA cache with the reference's quantised keys, bit for bit."""
    scenario.result("prefill")
    for r in scenario.requests.values():
        torch.testing.assert_close(ls.read_cache(scenario.engine, r), ls.request_keys(scenario.engine, r),
                                   atol=0, rtol=0, msg=lambda m, r=r: f"request {r}: {m}")
