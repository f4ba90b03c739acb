"""SGLang's DeepSeek-V4 attention kernels' path on CPU with nsa-backend's replacements installed.

What runs is SGLang's own code around each replaced call, with the arguments its ``dsv4`` backend
builds (``DeepseekV4Backend._forward_attention`` and ``_forward_prefill_sparse``):

- the KV-cache write: ``deepseek_v4_memory_pool.fused_store_cache`` (the global the pool's
  ``set_swa_key_buffer_radix_fused`` calls) into SGLang-sized raw page buffers
  ``[num_pages, ceil(P * 584 / 576) * 576]``;
- decode: the backend's view of those buffers (``buf[:, :P * 584].view(pages, P, 1, 584)``, fp8) through
  ``flash_mla_sm120.flash_mla_with_kvcache_sm120`` (SM120 path) and ``flash_mla_interface.flash_mla_with_kvcache``
  with ``get_mla_metadata()[0]`` (SM90 / SM100 / SM8x path), sliding-window indices plus the compressed
  (extra) cache, ``topk_length`` / ``extra_topk_length`` and the attention sink;
- prefill: SGLang's Triton ``dequantize_k_cache_paged_dsv4`` fills the bf16 workspace (in the Triton
  interpreter), then ``flash_mla_interface.flash_mla_sparse_fwd`` with per-row merged indices and lengths.

References: plain-torch V4 attention over keys read back by SGLang's own page reader
(``flash_mla_sm120._gather_and_dequant``), and SGLang's own torch fallback ``_sm120_sparse_decode_fwd``.
The backend object itself (SGLang's ``DeepseekV4AttnBackend`` from its registry, the V4 token pool, the
prefill / decode metadata builders and ``forward`` of a window-only layer) runs in
``test_sglang_v4_backend.py``. Not exercised on CPU: the model's compressor / indexer / mHC modules and
compressed layers' metadata (SGLang's compressor plans and kernels are CUDA JIT with no CPU path).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("sglang")

import torch

from nsa_backend import routing
from nsa_backend_integrations.sglang import dsv4

P = 64  # tokens per page (SGLang's SWA pages hold 256; the layout is the same for any P)
D = 512
H = 4
SCALE = D**-0.5


def _page_bytes(page_size: int) -> int:
    return math.ceil(page_size * 584 / 576) * 576


@pytest.fixture
def v4(routing_isolated, monkeypatch):
    """Replacements installed; the prefill / decode ops on their Triton kernels (CPU interpreter)."""
    monkeypatch.setenv("NSA_BACKEND_DECODE", "triton")
    monkeypatch.setenv("NSA_BACKEND_PREFILL", "triton")
    routing.reset_config()
    dsv4.deactivate()
    dsv4.activate()
    import sglang.kernels.ops.attention.flash_mla_sm120 as sm120
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool
    from sglang.kernels.ops.attention import flash_mla_interface

    yield pool, sm120, flash_mla_interface
    dsv4.deactivate()


def _write(pool, num_pages: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random latent rows stored through the pool module's ``fused_store_cache``; returns (buffer, rows)."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    buf = torch.zeros(num_pages, _page_bytes(P), dtype=torch.uint8)
    rows = (torch.randn(slots.numel(), D) * 2).to(torch.bfloat16)
    pool.fused_store_cache(input=rows, cache=buf, indices=slots, page_size=P, type="flashmla", layout=KVLayout.V4)
    return buf, rows


def _backend_view(buf: torch.Tensor) -> torch.Tensor:
    """The dsv4 backend's decode view of a raw page buffer (fp8, ``[pages, P, 1, 584]``)."""
    return buf.view(torch.float8_e4m3fn)[:, : P * 584].view(buf.shape[0], P, 1, 584)


def _reference(q, keys, valid, sink):
    """Plain-torch V4 attention: one softmax over the valid keys plus a sink logit with a zero value.

    q [N, H, D], keys [N, K, D] (bf16 values), valid [N, K] bool, sink [H]. Returns out [N, H, D], lse [N, H].
    """
    s = torch.einsum("nhd,nkd->nhk", q.float(), keys.float()) * SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    denom = torch.logaddexp(lse, sink.float()[None, :])
    p = torch.exp(s - denom[..., None])
    return torch.einsum("nhk,nkd->nhd", p, keys.float()), lse


def _decode_inputs(pool, sm120):
    gen = torch.Generator().manual_seed(1)
    swa_slots = torch.randperm(3 * P, generator=gen)[:100].to(torch.int32)
    swa_buf, swa_rows = _write(pool, 3, swa_slots)
    extra_slots = torch.arange(2 * P, dtype=torch.int32)[torch.randperm(2 * P, generator=gen)[:70]]
    extra_buf, _ = _write(pool, 2, extra_slots)
    B = 3
    # window: 64 slots per query (a multiple of 64, as the backend pads), some -1, lengths cut further
    indices = swa_slots[torch.randint(0, 100, (B, 1, 64), generator=gen)].clone()
    indices[0, 0, 50:] = -1
    topk_length = torch.tensor([50, 64, 17], dtype=torch.int32)
    extra_indices = extra_slots[torch.randint(0, 70, (B, 1, 64), generator=gen)].clone()
    extra_indices[1, 0, :5] = -1
    extra_topk_length = torch.tensor([64, 30, 0], dtype=torch.int32)
    q = torch.randn(B, 1, H, D, generator=gen).to(torch.bfloat16)
    sink = torch.randn(H, generator=gen)
    return dict(q=q, swa_buf=swa_buf, swa_slots=swa_slots, swa_rows=swa_rows, extra_buf=extra_buf,
                indices=indices, topk_length=topk_length, extra_indices=extra_indices,
                extra_topk_length=extra_topk_length, sink=sink)


def _decode_reference(sm120, x):
    swa = sm120._gather_and_dequant(_backend_view(x["swa_buf"]), x["indices"].clamp(min=0).long(), P)
    extra = sm120._gather_and_dequant(_backend_view(x["extra_buf"]), x["extra_indices"].clamp(min=0).long(), P)
    keys = torch.cat([swa, extra], dim=2)[:, 0]  # [B, 128, D]
    pos = torch.arange(64)
    valid = torch.cat([(x["indices"][:, 0] >= 0) & (pos < x["topk_length"][:, None]),
                       (x["extra_indices"][:, 0] >= 0) & (pos < x["extra_topk_length"][:, None])], dim=1)
    return _reference(x["q"][:, 0], keys, valid, x["sink"])


def test_cache_write_matches_sglang_reader(v4):
    """Rows stored through the pool's ``fused_store_cache`` read back by SGLang's own page reader: rope
    exact (bf16), nope within e4m3 rounding of its UE8M0 group scale."""
    pool, sm120, _ = v4
    slots = torch.tensor([0, 5, 63, 64, 130, 191], dtype=torch.int32)
    buf, rows = _write(pool, 3, slots)
    back = sm120._gather_and_dequant(_backend_view(buf), slots.long(), P)
    assert torch.equal(back[:, 448:], rows[:, 448:])
    group_amax = rows[:, :448].float().abs().view(-1, 7, 64).amax(-1, keepdim=True)
    err = (back[:, :448].float() - rows[:, :448].float()).abs().view(-1, 7, 64)
    assert bool((err <= group_amax * 2**-3 + 1e-6).all()), f"max relative error {(err / group_amax).max()}"
    untouched = torch.ones(3 * P, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.count_nonzero(
        sm120._gather_and_dequant(_backend_view(buf), torch.nonzero(untouched)[:, 0], P).float()) == 0


def test_decode_sm120_entry_matches_reference(v4):
    pool, sm120, _ = v4
    x = _decode_inputs(pool, sm120)
    out, lse = sm120.flash_mla_with_kvcache_sm120(
        q=x["q"], k_cache=_backend_view(x["swa_buf"]), head_dim_v=D, softmax_scale=SCALE, indices=x["indices"],
        topk_length=x["topk_length"], attn_sink=x["sink"], extra_k_cache=_backend_view(x["extra_buf"]),
        extra_indices_in_kvcache=x["extra_indices"], extra_topk_length=x["extra_topk_length"])
    ref_out, ref_lse = _decode_reference(sm120, x)
    assert out.shape == (3, 1, H, D) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:, 0].float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, :, 0], ref_lse, atol=1e-3, rtol=1e-3)
    # SGLang's own torch fallback on the same cache agrees (its lse excludes the sink, as ours)
    sg_out, sg_lse = sm120._sm120_sparse_decode_fwd(
        x["q"], _backend_view(x["swa_buf"]), x["indices"], x["topk_length"], x["sink"], D, SCALE,
        _backend_view(x["extra_buf"]), x["extra_indices"], x["extra_topk_length"])
    torch.testing.assert_close(out.float(), sg_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, sg_lse, atol=1e-3, rtol=1e-3)


def test_decode_flashmla_entry_matches_reference(v4):
    """The SM90 / SM100 / SM8x call form: keywords of the backend's partial, schedule placeholder."""
    pool, sm120, interface = v4
    x = _decode_inputs(pool, sm120)
    meta = interface.get_mla_metadata()[0]
    out, lse = interface.flash_mla_with_kvcache(
        q=x["q"], k_cache=_backend_view(x["swa_buf"]), head_dim_v=D, block_table=None, cache_seqlens=None,
        tile_scheduler_metadata=meta, softmax_scale=SCALE, is_fp8_kvcache=True, indices=x["indices"],
        topk_length=x["topk_length"], attn_sink=x["sink"], extra_k_cache=_backend_view(x["extra_buf"]),
        extra_indices_in_kvcache=x["extra_indices"], extra_topk_length=x["extra_topk_length"], use_legacy=True)
    ref_out, ref_lse = _decode_reference(sm120, x)
    torch.testing.assert_close(out[:, 0].float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, :, 0], ref_lse, atol=1e-3, rtol=1e-3)


def test_prefill_through_sglang_workspace(v4):
    """SGLang's prefill: dequantise window + compressed tokens into one bf16 workspace (its Triton kernel),
    then ``flash_mla_sparse_fwd`` over per-row rebased indices with lengths and the sink."""
    pool, _, interface = v4
    from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged_dsv4

    gen = torch.Generator().manual_seed(2)
    extra_slots = torch.arange(20, dtype=torch.int32) * 3
    extra_buf, _ = _write(pool, 1, extra_slots)
    swa_slots = torch.arange(40, dtype=torch.int32) + 70
    swa_buf, _ = _write(pool, 2, swa_slots)
    workspace = torch.empty(60, 1, D, dtype=torch.bfloat16)
    dequantize_k_cache_paged_dsv4(extra_buf, extra_slots, page_size=P, out=workspace[:20])
    dequantize_k_cache_paged_dsv4(swa_buf, swa_slots, page_size=P, out=workspace[20:])
    s_q, topk = 5, 64
    indices = torch.randint(0, 60, (s_q, topk), generator=gen, dtype=torch.int32)
    indices[2, 10:20] = -1
    topk_length = torch.tensor([64, 40, 33, 1, 0], dtype=torch.int32)
    q = torch.randn(s_q, H, D, generator=gen).to(torch.bfloat16)
    sink = torch.randn(H, generator=gen)
    out, _, lse = interface.flash_mla_sparse_fwd(
        q=q, kv=workspace, indices=indices.unsqueeze(1), sm_scale=SCALE, d_v=D, attn_sink=sink,
        topk_length=topk_length)
    valid = (indices >= 0) & (torch.arange(topk) < topk_length[:, None])
    ref_out, ref_lse = _reference(q, workspace[:, 0][indices.clamp(min=0).long()], valid, sink)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[4], torch.zeros_like(out[4])), "a row without keys gives zeros"
    # FlashMLA's legacy statistics are base 2 (SGLang's default use_legacy=True)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite] / math.log(2), atol=1e-3, rtol=1e-3)
