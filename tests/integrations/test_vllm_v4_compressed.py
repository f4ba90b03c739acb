"""vLLM's own DeepSeek-V4 compressed attention layers on the CPU with nsa-backend's class: C4A
(``compress_ratio`` 4: vLLM's compressor, its indexer with the indexer's own compressor, key cache and
top-k) and C128A (``compress_ratio`` 128: the compressor, every compressed token attended), prefill then
decode, built by vLLM's wrapped ``_select_dsv4_attn_cls`` for ``--attention-backend CUSTOM``.

What runs is vLLM's code (projections, compressors and their Triton kernels in the interpreter, the
indexer's q quantisation and key insert, every metadata builder: SWA, compressed, compressor state,
indexer) except nsa-backend's calls (cache write, ``sparse_mla_decode`` with the compressed keys as the
extra key list, the indexer logits through ``dsv4_indexer``) and these CPU stand-ins, each for something
that needs a GPU:

- ``aten::mm.dtype`` (``torch.mm(..., out_dtype=float32)``, the compressors' score projections): CUDA-only
  in torch; a float32 matmul (:func:`vllm_v4_layer_support.register_cpu_mm_out_dtype`);
- ``vllm._custom_ops.cp_gather_indexer_k_quant_cache`` (a ``vllm._C`` CUDA op, absent from a CPU install;
  gathers each prefill request's indexer keys): a torch gather (:func:`vllm_v4_layer_support.gather_indexer_k`);
- ``vllm._custom_ops.top_k_per_row_prefill`` (a ``vllm._C`` CUDA op): :func:`nsa_backend.topk_indices`,
  made relative to each row's start as vLLM's op returns them (vLLM passes DeepGEMM's compressed logits with
  zero starts, and localises ROCm's absolute indices the same way);
- the decode top-k (vLLM's CUDA op by default): vLLM's own ``torch`` backend (``sparse_indexer_topk_backend``);
- ``fused_indexer_q.has_cutedsl`` reports ``False`` (the CuTeDSL q-quantisation kernel needs CUDA; vLLM's
  Triton kernel runs instead);
- ``vllm.v1.attention.backends.mla.indexer.num_compute_units`` (a CUDA device query for the decode
  schedule): a constant;
- vLLM's workspace manager initialised on the CPU (the GPU runner does it on the GPU);
- the Triton interpreter's float32 -> e4m3 / bf16 conversion (it drops a rounded-up mantissa's carry): torch's
  round-to-nearest-even, as in ``test_vllm_v4_layer.py`` (its ``vllm_on_cpu`` fixture).

On this CPU platform vLLM picks the FP8 indexer key cache (MXFP4 is sm_10x-only in vLLM), so the
indexer logits run through ``dsv4_indexer``'s FP8 route (``nsa_backend.fp8_mqa_logits`` /
``fp8_paged_mqa_logits``).

Reference (``vllm_v4_layer_support.reference_step``): queries and the sliding window recomputed from the
weights, with the compressed layers' RoPE (base ``compress_rope_theta``, not the sliding-window layers'
``rope_theta``); the compressed keys are vLLM's compressor's output decoded from the compressed cache bytes
(:func:`read_compressed`), all ``(p + 1) // ratio`` of them for C128A and those of the indexer's top-k
buffer for C4A (checked to be distinct, in range, and as many as the top-k allows). Tolerance as in
``test_vllm_v4_layer.py``: the SWA cache bit for bit, outputs within 1.5% of the largest magnitude plus 2%.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integrations import vllm_fixtures as vf  # noqa: E402
from tests.integrations import vllm_v4_layer_support as ls  # noqa: E402
from tests.integrations.test_vllm_v4_layer import vllm_on_cpu  # noqa: E402, F401

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins for vLLM's CUDA-only ops")

# A outgrows the window and (at 130 tokens) holds 32 C4 / one C128 compressed key; B holds 2 C4 keys.
SCENARIO = {"prefill": [("A", 130), ("B", 9)], "decode": [("A", 1), ("B", 1)]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return vf.model_dir(tmp_path_factory, "dsv4-compressed", ls.COMPRESSED_CONFIG)


@pytest.fixture(scope="module")
def cpu_stand_ins():
    """The CPU stand-ins of the module docstring, undone afterwards."""
    import vllm._custom_ops as custom_ops
    import vllm.models.deepseek_v4.common.ops.fused_indexer_q as fused_indexer_q
    import vllm.v1.attention.backends.mla.indexer as indexer_backend
    from vllm.v1.worker import workspace

    mp = pytest.MonkeyPatch()
    lib = ls.register_cpu_mm_out_dtype()
    mp.setattr(custom_ops, "cp_gather_indexer_k_quant_cache", ls.gather_indexer_k, raising=False)
    mp.setattr(custom_ops, "top_k_per_row_prefill", ls.top_k_per_row_prefill, raising=False)
    mp.setattr(fused_indexer_q, "has_cutedsl", lambda: False)
    mp.setattr(indexer_backend, "num_compute_units", lambda device=None: 8)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    yield
    mp.undo()
    lib._destroy()


class Scenario:
    def __init__(self, ratio: int, model_dir: str, dsv4) -> None:
        from nsa_backend_integrations.vllm.config import load_settings

        dsv4.install(load_settings(overrides={"takeover": "off"}), lambda: None)
        config = ls.make_compressed_vllm_config(model_dir, "CUSTOM")
        config.kernel_config.sparse_indexer_topk_backend = "torch"
        self.engine = ls.CompressedLayerEngine(config, ratio)
        self.requests = {name: self.engine.add_request(ls.COMPRESSED_MAX_TOKENS) for name in ("A", "B")}
        self.results: dict[str, tuple[ls.Step, torch.Tensor]] = {}

    def selected(self, step: ls.Step) -> torch.Tensor:
        """The compressed positions each token attends: ``[T, K]`` (``-1``: none)."""
        layer, ratio = self.engine.layer, self.engine.ratio
        if ratio == 4:
            return layer.topk_indices_buffer[: len(step.token_request)].clone()
        count = max((p + 1) // ratio for p in step.token_position)
        span = torch.arange(max(1, count))[None, :]
        limit = torch.tensor([(p + 1) // ratio for p in step.token_position])[:, None]
        return torch.where(span < limit, span, -1)

    def run(self) -> None:
        for name, schedule in SCENARIO.items():
            step = self.engine.step([(self.requests[r], n) for r, n in schedule])
            chosen = self.selected(step)
            keys = {r: ls.read_compressed(self.engine, r) for r in set(step.token_request)}

            def extra(t: int, r: int, p: int, chosen=chosen, keys=keys) -> torch.Tensor:
                idx = [int(i) for i in chosen[t] if i >= 0]
                return keys[r][idx]

            self.results[name] = (step, ls.reference_step(self.engine, step, extra), chosen)


@pytest.fixture(scope="module", params=[4, 128], ids=["c4a", "c128a"])
def scenario(request, vllm_on_cpu, cpu_stand_ins, model_dir):  # noqa: F811
    _, dsv4 = vllm_on_cpu
    s = Scenario(request.param, model_dir, dsv4)
    s.run()
    return s


def test_layer_is_nsa_backends_with_vllms_compressor(scenario):
    from nsa_backend_integrations.vllm.dsv4 import NsaDeepseekV4Attention

    layer = scenario.engine.layer
    assert type(layer) is NsaDeepseekV4Attention and layer.compress_ratio == scenario.engine.ratio
    assert layer.compressor is not None
    assert (layer.indexer is not None) == (scenario.engine.ratio == 4)


@pytest.mark.parametrize("step_name", list(SCENARIO))
def test_compressed_layer_matches_reference(scenario, step_name):
    step, reference, _ = scenario.results[step_name]
    out = step.output.float()
    atol = 0.015 * float(reference.abs().max())
    torch.testing.assert_close(out, reference, atol=atol, rtol=0.02, msg=lambda m: f"{step_name}: {m}")


@pytest.mark.parametrize("step_name", list(SCENARIO))
def test_selected_compressed_tokens_are_valid(scenario, step_name):
    """Every token attends min(top-k, visible) distinct compressed keys it can see (C4A: the indexer's
    choice; C128A: all of them), and at least one where one exists."""
    step, _, chosen = scenario.results[step_name]
    topk = scenario.engine.hf_config.index_topk
    for t, p in enumerate(step.token_position):
        visible = (p + 1) // scenario.engine.ratio
        idx = [int(i) for i in chosen[t] if i >= 0]
        want = min(topk, visible) if scenario.engine.ratio == 4 else visible
        assert len(idx) == want and len(set(idx)) == len(idx) and all(0 <= i < visible for i in idx), (t, p, idx)


def test_cache_holds_v4_rows(scenario):
    """nsa-backend's writer filled vLLM's SWA cache with the reference's quantised keys, bit for bit."""
    for r in scenario.requests.values():
        torch.testing.assert_close(ls.read_cache(scenario.engine, r), ls.request_keys(scenario.engine, r),
                                   atol=0, rtol=0, msg=lambda m, r=r: f"request {r}: {m}")
