"""SGLang's own DeepSeek-V4 ``dsv4`` backend object on CPU with nsa-backend's replacements installed.

Built by ``sglang_v4_layer_support``: SGLang's ``DeepSeekV4TokenToKVPool`` (584-byte V4 rows, 256-token
pages), ``ReqToTokenPool``, the batch's KV plan (``KVIndexTranslator``), ``ForwardBatch`` and the backend
from SGLang's attention registry (``ATTENTION_BACKENDS["dsv4"]``, ``DeepseekV4AttnBackend``). Each case runs
two requests through a prefill (150 and 40 new tokens: the first one past the 128-token window) and a
decode step, each time through the backend's own ``init_forward_metadata`` (prefill / decode metadata
builders: window page indices and lengths, the sparse-prefill chunk cache) and its ``forward`` with the
attention sink, as the V4 model's MQA calls it for a window-only layer (``compress_ratio=0``). Inside,
SGLang's code writes the cache (``store_cache`` -> ``set_swa_key_buffer_radix_fused`` -> the pool module's
``fused_store_cache``, replaced) and calls, per path:

- ``flashmla`` (SM90 / SM100 form, SGLang's default sparse prefill): prefill through SGLang's Triton
  ``dequantize_k_cache_paged_dsv4`` workspace and ``flash_mla_interface.flash_mla_sparse_fwd``; decode
  through the ``flash_mla_with_kvcache`` partial the constructor binds;
- ``flashmla_kv`` (``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=0``): the prefill rows through that same partial;
- ``sm120`` (SGLang's ``override_platform(is_sm120=True)``): both through
  ``flash_mla_sm120.flash_mla_with_kvcache_sm120``.

Checks: the pool's page bytes equal nsa-backend's reference V4 writer fed the same rows at the same slots
(after the prefill and after the decode step); every output row equals a plain-torch float32 window
attention (keys ``[max(0, p - 127), p]`` of its own request, e4m3 nope with power-of-two group scales and
bf16 rope, plus the sink logit) within bf16 tolerance; the call reached nsa-backend's op (counted).

Not run: layers with compressed keys (``compress_ratio`` 4 / 128). Their metadata needs SGLang's
compressor plan builders (``CompressorPrefillPlan.generate`` / ``CompressorDecodePlan``), CUDA JIT
kernels with no CPU path (the XPU variant is a compiled ``sgl_kernel`` op), and the compressed caches are
filled by the compressor's fused CUDA kernels. Nor SGLang's ``MQALayer``: its projections store the key
through ``fused_k_norm_rope_flashmla`` and rotate q with ``fused_rope_inplace`` (CUDA JIT). The compressed
(extra) key list and the V4 attention with it are covered by ``test_sglang_v4_layer.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch

import nsa_backend
from nsa_backend import routing
from nsa_backend_integrations.sglang import dsv4

from . import sglang_layer_support as v3
from . import sglang_v4_layer_support as v4

PREFIX_COUNTS = [150, 40]  # request 0 runs past the window; request 1 stays inside it
PATHS = ["flashmla", "flashmla_kv", "sm120"]
# nsa-backend op each path's calls reach, (prefill, decode)
OPS = {
    "flashmla": ("flash_mla_sparse_fwd", "sparse_mla_decode"),
    "flashmla_kv": ("sparse_mla_decode", "sparse_mla_decode"),
    "sm120": ("sparse_mla_decode", "sparse_mla_decode"),
}


@pytest.fixture
def replaced(routing_isolated, monkeypatch):
    """nsa-backend's V4 replacements installed (what the plugin does when it loads); the attention ops on
    their reference implementation (the Triton kernels' numbers are covered by the op tests)."""
    monkeypatch.setenv("NSA_BACKEND_DECODE", "reference")
    monkeypatch.setenv("NSA_BACKEND_PREFILL", "reference")
    routing.reset_config()
    dsv4.deactivate()
    dsv4.activate()
    v3.init_process()
    calls = {"flash_mla_sparse_fwd": 0, "sparse_mla_decode": 0, "write_fp8_ds_mla_v4_cache": 0}
    for name in calls:
        original = getattr(nsa_backend, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(nsa_backend, name, counted)
    yield calls
    dsv4.deactivate()


def _path(monkeypatch, path: str):
    """The platform / environment selecting ``path`` in SGLang's backend (a context manager)."""
    import contextlib

    from sglang.srt.runtime_context import override_platform

    monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0" if path == "flashmla_kv" else "1")
    return override_platform(is_sm120=True) if path == "sm120" else contextlib.nullcontext()


def _step(backend, runner, layer, prefix, counts, keys, q, sink):
    """Metadata and one attention call; ``keys[r]`` gets this step's bf16 key rows of request ``r``."""
    fb = v4.forward_batch(runner, backend, prefix, counts)
    backend.init_forward_metadata(fb)
    k = torch.cat([keys[r][p: p + n] for r, (p, n) in enumerate(zip(prefix, counts))])
    with torch.no_grad():
        out = backend.forward(q, k, k, layer, fb, compress_ratio=0, attn_sink=sink)
    return fb, out


def _check(out, q, keys, prefix, counts, sink):
    """Each output row against the float32 window attention of its own request."""
    row = 0
    for r, (p, n) in enumerate(zip(prefix, counts)):
        stored = v4.stored_key(keys[r])
        for pos in range(p, p + n):
            expect = v4.window_attention(q[row], stored[max(0, pos - v4.WINDOW + 1): pos + 1], sink)
            torch.testing.assert_close(out[row].float(), expect, atol=2e-2, rtol=2e-2,
                                       msg=lambda m, r=r, pos=pos: f"request {r} position {pos}: {m}")
            row += 1


@pytest.mark.parametrize("path", PATHS)
def test_backend_prefill_then_decode(replaced, monkeypatch, path):
    gen = torch.Generator().manual_seed(3)
    seq = [n + 1 for n in PREFIX_COUNTS]  # the prompt and one decoded token per request
    keys = [(torch.randn(s, v4.D, generator=gen) * 2).to(torch.bfloat16) for s in seq]
    sink = torch.randn(v4.HEADS, generator=gen)
    layer = v4.radix_layer()
    with _path(monkeypatch, path):
        runner, backend = v4.build_backend(monkeypatch, num_reqs=2)
        assert type(backend).__name__ == "DeepseekV4AttnBackend"
        pool = runner.token_to_kv_pool
        rows: dict[int, torch.Tensor] = {}

        steps = [("prefill", [0, 0], PREFIX_COUNTS), ("decode", PREFIX_COUNTS, [1, 1])]
        for (name, prefix, counts), op in zip(steps, OPS[path]):
            before = dict(replaced)
            q = (torch.randn(sum(counts), v4.HEADS, v4.D, generator=gen)).to(torch.bfloat16)
            _, out = _step(backend, runner, layer, prefix, counts, keys, q, sink)
            for r, (p, n) in enumerate(zip(prefix, counts)):
                rows.update({v4.slot(r, i): keys[r][i] for i in range(p, p + n)})
            assert out.shape == (sum(counts), v4.HEADS, v4.D), f"{name}: output shape {tuple(out.shape)}"
            raw = pool.get_swa_raw_buffer(0)
            assert torch.equal(raw, v4.reference_cache(rows, raw)), f"{name}: cache bytes differ from the reference"
            assert replaced["write_fp8_ds_mla_v4_cache"] == before["write_fp8_ds_mla_v4_cache"] + 1, name
            assert replaced[op] > before[op], f"{name}: nsa-backend's {op} was not called"
            _check(out, q, keys, prefix, counts, sink)
