"""DeepSeek-V4 C4A indexer logits routed to nsa-backend's MXFP4 and FP8 ops (``integrations/vllm/dsv4_indexer.py``).

- contract: every call of ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits`` that reaches the names
  in ``vllm.model_executor.layers.sparse_attn_indexer`` binds to the replacement, and that module looks
  them up when it runs (its module-level import is what the replacement overwrites);
- numbers: the installed names called as vLLM's indexer calls them (int8 views of packed MXFP4, int32
  UE8M0 x4 scales, the 4-D page view of vLLM's ``kv_cache_as_quant_view`` over strided pages) equal
  ``nsa_backend.reference`` on the same data, for 64 heads and 16 (which DeepGEMM refuses), ``-inf``
  for keys a row cannot see;
- FP8: vLLM's FP8 indexer operands (its default cache everywhere but SM10x: e4m3 q without a scale, e4m3
  keys with fp32 scales, 132-byte cache rows) reach ``nsa_backend.fp8_mqa_logits`` /
  ``fp8_paged_mqa_logits`` (never vLLM's function) and equal ``nsa_backend.reference``; SM10x's FP8 form
  (UE8M0 int32 scales) and other row widths still go to vLLM's function;
- install: the names are replaced exactly when the DeepSeek-V4 selector picks nsa-backend's class.
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from nsa_backend import reference as ref  # noqa: E402
from tests.integrations.test_vllm_contracts import (  # noqa: E402
    assert_sites_bind,
    call_sites_of_module_attribute,
    module_level_imports,
)

LAYER = "vllm.model_executor.layers.sparse_attn_indexer"
NAMES = ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits")
D = 128
PAGE = 64


@pytest.fixture(scope="module")
def v4i():
    from nsa_backend_integrations.vllm import dsv4_indexer

    return dsv4_indexer


@pytest.fixture
def installed(v4i):
    """The replacements installed; vLLM's functions restored afterwards."""
    v4i.install()
    yield importlib.import_module(LAYER)
    v4i.uninstall()


def _logits_dtype_kw() -> dict:
    """vLLM 0.34's call sites pass ``logits_dtype``; 0.33's do not."""
    from vllm.utils.deep_gemm import fp8_fp4_mqa_logits

    return {"logits_dtype": torch.float32} if "logits_dtype" in inspect.signature(fp8_fp4_mqa_logits).parameters else {}


# --- contract ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_every_call_site_binds_to_the_replacement(installed, v4i, name):
    ours = getattr(installed, name)
    assert ours is v4i.REPLACEMENTS[name]
    sites = call_sites_of_module_attribute(LAYER, name)
    assert sites, f"vLLM's indexer layer no longer calls {name}"
    assert_sites_bind(inspect.signature(ours), sites, f"{LAYER}.{name}")


@pytest.mark.parametrize("name", NAMES)
def test_replacement_takes_every_parameter_of_vllms_function(v4i, name):
    """Every parameter vLLM's ``vllm.utils.deep_gemm.<name>`` takes (0.33 or 0.34), by name."""
    theirs = inspect.signature(getattr(importlib.import_module("vllm.utils.deep_gemm"), name)).parameters
    ours = inspect.signature(v4i.REPLACEMENTS[name]).parameters
    missing = [p for p in theirs if p not in ours]
    assert not missing, f"{name}: parameters of vLLM's function the replacement lacks: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_v4_code_reaches_the_replaced_names(name):
    """The indexer layer binds ``name`` by a module-level import from ``vllm.utils.deep_gemm`` (the
    attribute replaced, read by its functions when they run), and no DeepSeek-V4 module binds its own
    copy at import time (such a copy would bypass the replacement)."""
    bound = module_level_imports("vllm.utils.deep_gemm", name)
    assert any(site.startswith("vllm/model_executor/layers/sparse_attn_indexer.py:") for site in bound), bound
    v4_copies = [site for site in bound if site.startswith("vllm/models/deepseek_v4/")]
    assert not v4_copies, f"DeepSeek-V4 modules binding {name} at import time: {v4_copies}"


# --- numbers ----------------------------------------------------------------------------------------

def _mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., 128]`` -> (packed uint8 [..., 64], scales uint8 [..., 4], scales as vLLM's int32 [...])."""
    packed, scales = ref.quantize_mxfp4(x)
    scales = scales.contiguous()
    return packed, scales, scales.view(torch.int32).squeeze(-1)


def _vllm_page_view(pages: torch.Tensor) -> torch.Tensor:
    """``[P, PAGE, 1, 68]`` pages copied into vLLM's 3-D indexer allocation (page stride padded past the
    page, as vLLM's hybrid-cache pages are) and viewed through vLLM's ``kv_cache_as_quant_view``."""
    from vllm.model_executor.layers.sparse_attn_indexer import kv_cache_as_quant_view

    P, row = pages.shape[0], pages.shape[-1]
    page_bytes = PAGE * row + 96
    storage = torch.full((P, page_bytes), 0xEE, dtype=torch.uint8)
    storage[:, : PAGE * row] = pages.reshape(P, -1)
    alloc = torch.as_strided(storage, (P, PAGE, row), (page_bytes, row, 1))
    return kv_cache_as_quant_view(alloc, D, True)


@pytest.fixture(params=["auto", "triton"])
def kernel(request, monkeypatch):
    """Which nsa-backend implementation serves the routed calls: ``auto`` (the reference on this CPU)
    or the Triton kernels (the GPU path, here in the interpreter)."""
    import functools

    import nsa_backend

    if request.param != "auto":
        for name in NAMES:
            monkeypatch.setattr(nsa_backend, name, functools.partial(getattr(nsa_backend, name), impl=request.param))
    return request.param


@pytest.mark.parametrize("heads", [64, 16])
def test_paged_logits_as_vllm_calls_them(installed, heads, kernel):
    gen = torch.Generator().manual_seed(heads)
    B, n_keys = 3, 150
    keys = torch.randn(n_keys, D, generator=gen)
    pages = ref.pack_indexer_k_cache_fp4(keys, PAGE)                       # [3, 64, 1, 68]
    kv_cache = _vllm_page_view(pages)
    q_packed, q_sc8, q_sc32 = _mxfp4(torch.randn(B, 1, heads, D, generator=gen))
    weights = torch.rand(B, heads, generator=gen)
    seq_lens = torch.tensor([[150], [70], [1]], dtype=torch.int32)         # [B, next_n], as vLLM builds it
    block_table = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    schedule = torch.zeros(9, 2, dtype=torch.int32)
    max_model_len = 192
    # vLLM's decode call: q values viewed as int8, keyword max_model_len / indices (and logits_dtype on 0.34).
    out = installed.fp8_fp4_paged_mqa_logits(
        (q_packed.view(torch.int8), q_sc32), kv_cache, weights, seq_lens, block_table, schedule,
        max_model_len=max_model_len, indices=None, **_logits_dtype_kw())
    expected = ref.fp8_fp4_paged_mqa_logits(q_packed, q_sc8, pages, weights, seq_lens, block_table, None,
                                            max_model_len)
    assert out.shape == (B, max_model_len) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    cols = torch.arange(max_model_len)[None, :]
    invisible = cols >= seq_lens.view(-1, 1)
    assert torch.isneginf(out[invisible]).all()
    assert torch.isfinite(out[~invisible]).all()


@pytest.mark.parametrize("heads", [64, 16])
def test_varlen_paged_logits_as_vllm_calls_them(installed, heads, kernel):
    """DeepGEMM's varlen form (``indices``, one block-table row and context length per query row)."""
    gen = torch.Generator().manual_seed(100 + heads)
    keys = torch.randn(128, D, generator=gen)
    pages = ref.pack_indexer_k_cache_fp4(keys, PAGE)
    kv_cache = _vllm_page_view(pages)
    rows = 2
    q_packed, q_sc8, q_sc32 = _mxfp4(torch.randn(rows, 1, heads, D, generator=gen))
    weights = torch.rand(rows, heads, generator=gen)
    seq_lens = torch.tensor([100, 101], dtype=torch.int32)
    block_table = torch.tensor([[1, 0], [1, 0]], dtype=torch.int32)
    out = installed.fp8_fp4_paged_mqa_logits(
        (q_packed.view(torch.int8), q_sc32), kv_cache, weights, seq_lens, block_table,
        torch.zeros(3, 2, dtype=torch.int32), max_model_len=128, indices=torch.zeros(rows, dtype=torch.int32),
        **_logits_dtype_kw())
    expected = ref.fp8_fp4_paged_mqa_logits(q_packed, q_sc8, pages, weights, seq_lens, block_table, None, 128)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.isneginf(out[0, 100:]).all() and torch.isneginf(out[1, 101:]).all()


@pytest.mark.parametrize("heads", [64, 16])
def test_ragged_logits_as_vllm_calls_them(installed, heads, kernel):
    gen = torch.Generator().manual_seed(200 + heads)
    M, N = 4, 40
    q_packed, q_sc8, q_sc32 = _mxfp4(torch.randn(M, heads, D, generator=gen))
    k_packed, k_sc8, k_sc32 = _mxfp4(torch.randn(N, D, generator=gen))
    weights = torch.rand(M, heads, generator=gen)
    ks = torch.tensor([0, 0, 10, 25], dtype=torch.int32)
    ke = torch.tensor([5, 20, 30, 40], dtype=torch.int32)
    max_seqlen_k = int((ke - ks).max())
    # vLLM's prefill call: int8 values, int32 scales squeezed to [N] / [M, H].
    out = installed.fp8_fp4_mqa_logits(
        (q_packed.view(torch.int8), q_sc32), (k_packed.view(torch.int8), k_sc32), weights, ks, ke,
        max_seqlen_k, **_logits_dtype_kw())
    expected = ref.fp8_fp4_mqa_logits(q_packed, q_sc8, k_packed, k_sc8, weights, ks, ke, True, max_seqlen_k)
    assert out.shape == (M, max_seqlen_k)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    cols = torch.arange(max_seqlen_k)[None, :]
    invisible = cols >= (ke - ks)[:, None]
    assert torch.isneginf(out[invisible]).all()
    assert torch.isfinite(out[~invisible]).all()


# --- FP8 indexer operands (vLLM's default indexer cache everywhere but SM10x) ---------------------------

FP8_NAMES = ("fp8_mqa_logits", "fp8_paged_mqa_logits")


@pytest.fixture(params=["auto", "triton"])
def fp8_calls(request, v4i, monkeypatch):
    """nsa-backend's FP8 logits ops recorded (``auto``: the reference on this CPU; ``triton``: the Triton
    kernels in the interpreter), and vLLM's functions made to fail if the replacement falls through to them."""
    import nsa_backend

    calls: list[str] = []
    for name in FP8_NAMES:
        op = getattr(nsa_backend, name)

        def recorded(*args, _op=op, _name=name, **kwargs):
            calls.append(_name)
            return _op(*args, **kwargs, **({} if request.param == "auto" else {"impl": request.param}))

        monkeypatch.setattr(nsa_backend, name, recorded)

    def vllms(*args, **kwargs):
        raise AssertionError("FP8 indexer operands reached vLLM's DeepGEMM function")

    for name in NAMES:
        monkeypatch.setitem(v4i._ORIGINALS, name, vllms)
    return calls


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _vllm_fp8_page_view(pages: torch.Tensor) -> torch.Tensor:
    """``[P, PAGE, 1, 132]`` pages in vLLM's 3-D FP8 indexer allocation (page stride padded past the page),
    viewed through vLLM's ``kv_cache_as_quant_view`` (FP8: the allocation with a unit head axis)."""
    from vllm.model_executor.layers.sparse_attn_indexer import kv_cache_as_quant_view

    P, row = pages.shape[0], pages.shape[-1]
    page_bytes = PAGE * row + 64
    storage = torch.full((P, page_bytes), 0xEE, dtype=torch.uint8)
    storage[:, : PAGE * row] = pages.reshape(P, -1)
    alloc = torch.as_strided(storage, (P, PAGE, row), (page_bytes, row, 1))
    return kv_cache_as_quant_view(alloc, D, False)


@pytest.mark.parametrize("heads", [64, 16])
def test_fp8_ragged_logits_as_vllm_calls_them(installed, heads, fp8_calls):
    """vLLM's FP8 prefill call (e4m3 q without a scale, e4m3 keys with fp32 scales) runs
    ``nsa_backend.fp8_mqa_logits`` and returns DeepGEMM's compressed logits (row ``i`` column ``j``: key
    ``ks[i] + j``), ``-inf`` past a row's window."""
    gen = torch.Generator().manual_seed(300 + heads)
    M, N = 4, 40
    q = _fp8(torch.randn(M, heads, D, generator=gen))
    k = _fp8(torch.randn(N, D, generator=gen))
    k_scale = torch.rand(N, generator=gen) + 0.5
    weights = torch.rand(M, heads, generator=gen)
    ks = torch.tensor([0, 0, 10, 25], dtype=torch.int32)
    ke = torch.tensor([5, 20, 30, 40], dtype=torch.int32)
    max_seqlen_k = int((ke - ks).max())
    out = installed.fp8_fp4_mqa_logits((q, None), (k, k_scale), weights, ks, ke, max_seqlen_k, **_logits_dtype_kw())
    assert fp8_calls == ["fp8_mqa_logits"]
    expected = ref.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, True, max_seqlen_k)
    assert out.shape == (M, max_seqlen_k) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    invisible = torch.arange(max_seqlen_k)[None, :] >= (ke - ks)[:, None]
    assert torch.isneginf(out[invisible]).all() and torch.isfinite(out[~invisible]).all()


@pytest.mark.parametrize("heads", [64, 16])
@pytest.mark.parametrize("form", ["batch", "varlen"])
def test_fp8_paged_logits_as_vllm_calls_them(installed, heads, form, fp8_calls):
    """vLLM's FP8 decode call (e4m3 q without a scale, the 132-byte-row cache through
    ``kv_cache_as_quant_view``; batch form with ``[B, next_n]`` lengths, or DeepGEMM's varlen form with
    ``indices`` and one block-table row per query row) runs ``nsa_backend.fp8_paged_mqa_logits``."""
    gen = torch.Generator().manual_seed(400 + heads)
    keys = torch.randn(150, D, generator=gen)
    pages = ref.pack_indexer_k_cache(keys, PAGE)                           # [3, 64, 1, 132]
    kv_cache = _vllm_fp8_page_view(pages)
    B, max_model_len = 3, 192
    q = _fp8(torch.randn(B, 1, heads, D, generator=gen))
    weights = torch.rand(B, heads, generator=gen)
    block_table = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    if form == "batch":
        seq_lens, indices = torch.tensor([[150], [70], [1]], dtype=torch.int32), None
    else:
        seq_lens, indices = torch.tensor([150, 70, 1], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    out = installed.fp8_fp4_paged_mqa_logits(
        (q, None), kv_cache, weights, seq_lens, block_table, torch.zeros(9, 2, dtype=torch.int32),
        max_model_len=max_model_len, indices=indices, **_logits_dtype_kw())
    assert fp8_calls == ["fp8_paged_mqa_logits"]
    expected = ref.fp8_paged_mqa_logits(q, pages, weights, seq_lens, block_table, None, max_model_len, True)
    assert out.shape == (B, max_model_len) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    invisible = torch.arange(max_model_len)[None, :] >= seq_lens.view(-1, 1)
    assert torch.isneginf(out[invisible]).all() and torch.isfinite(out[~invisible]).all()


def test_other_operands_stay_on_vllms_function(installed, v4i, monkeypatch):
    """Operands neither MXFP4 nor vLLM's FP8 form go to vLLM's function unchanged (``logits_dtype`` only
    when it is not the default): SM10x's FP8 form (UE8M0 int32 key scales, unit MX q scales) and a cache
    row width that is neither 68 nor 132 bytes."""
    import nsa_backend

    seen = []
    monkeypatch.setitem(v4i._ORIGINALS, "fp8_fp4_mqa_logits", lambda *a, **k: seen.append((a, k)) or "vllm")
    monkeypatch.setitem(v4i._ORIGINALS, "fp8_fp4_paged_mqa_logits", lambda *a, **k: seen.append((a, k)) or "vllm")
    for name in (*FP8_NAMES, *NAMES):
        monkeypatch.setattr(nsa_backend, name, lambda *a, **k: pytest.fail("routed to nsa-backend"))
    fp8 = torch.zeros(4, D, dtype=torch.float8_e4m3fn)
    mx_scales = torch.ones(4, dtype=torch.int32)
    assert installed.fp8_fp4_mqa_logits((fp8[:, None], mx_scales[:, None]), (fp8, mx_scales), None, None, None,
                                        4) == "vllm"
    assert installed.fp8_fp4_mqa_logits((fp8[:, None], None), (fp8, mx_scales), None, None, None, 4) == "vllm"
    sm10x_cache = torch.zeros(1, PAGE, 1, D + 4, dtype=torch.uint8)
    assert installed.fp8_fp4_paged_mqa_logits((fp8[:, None, None], mx_scales[:, None, None]), sm10x_cache, None,
                                              None, None, None, max_model_len=8) == "vllm"
    other_cache = torch.zeros(1, PAGE, 1, 100, dtype=torch.uint8)
    assert installed.fp8_fp4_paged_mqa_logits((fp8[:, None, None], None), other_cache, None, None, None, None,
                                              max_model_len=8) == "vllm"
    assert len(seen) == 4 and all("logits_dtype" not in kwargs for _, kwargs in seen)


# --- install ----------------------------------------------------------------------------------------

def _config(heads: int = 64) -> SimpleNamespace:
    """The fields of a VllmConfig the DeepSeek-V4 decision reads (no backend named)."""
    return SimpleNamespace(
        attention_config=SimpleNamespace(backend=None),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(num_attention_heads=heads, sliding_window=128)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=64))


@pytest.mark.parametrize(("takeover", "arch", "picked_nsa"), [
    ("off", "sm89", False),    # takeover off: vLLM's class, DeepGEMM's logits
    ("auto", "sm89", True),    # no FlashMLA kernel on SM8x: nsa-backend's class and logits
    ("auto", None, True),      # no GPU
])
def test_installed_exactly_when_nsa_attention_is_selected(v4i, monkeypatch, takeover, arch, picked_nsa):
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from nsa_backend.routing import capabilities as caps
    from nsa_backend_integrations.vllm import dsv4
    from nsa_backend_integrations.vllm.config import load_settings

    monkeypatch.setattr(dsv4, "_vllm_flash_mla", lambda: caps.NativeStatus("flash_mla", True, vllm.__version__))
    module = importlib.import_module(LAYER)
    v4i.uninstall()
    originals = {name: getattr(module, name) for name in NAMES}
    try:
        select = dsv4._selector(lambda config: DeepseekV4FlashMLAAttention,
                                load_settings(overrides={"takeover": takeover}), lambda: arch)
        cls = select(_config())
        assert (cls is dsv4.NsaDeepseekV4Attention) == picked_nsa
        assert v4i.is_installed() == picked_nsa
        if not picked_nsa:
            assert all(getattr(module, name) is originals[name] for name in NAMES)
    finally:
        v4i.uninstall()
    assert all(getattr(module, name) is originals[name] for name in NAMES)
