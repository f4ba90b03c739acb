"""Portable Triton sparse MLA decode over the DeepSeek-V4 cache ("fp8_ds_mla_v4", 584 bytes per token).

FlashMLA's DeepSeek-V4 ``flash_mla_with_kvcache`` contract: query row ``(b, s)`` attends, in one
softmax, to ``indices[b, s, :topk_length[b]]`` of ``kv_cache`` (the sliding window) and to
``extra_indices[b, s, :extra_topk_length[b]]`` of ``extra_kv_cache`` (the compressed tokens); both
caches are block-split pages ``[P x 576 data bytes][P x 8 UE8M0 scale bytes]`` with their own page
size. Keys are the dequantised 512-dim rows, exactly as :func:`nsa_backend.unpack_fp8_ds_mla_v4`
(``bf16(fp32(e4m3) * 2^(byte - 127))`` for the 448 latent values, the 64 bf16 rope values as stored);
``V`` is the same row. The softmax runs in float32 online over blocks of ``BLOCK_K`` keys.

One program handles one query row and ``BLOCK_H`` heads (16, the smallest ``tl.dot`` tile; extra rows
are masked, so any ``h_q`` in 1..128 runs without padded heads in memory) and any ``topk``. The e4m3
bytes are decoded with integer arithmetic, so the kernel compiles for every architecture (sm_80 /
sm_86 have no e4m3 type in Triton). It is the portable fallback, not tuned for speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend.kernels.fp8_ds_mla.v4 import _fp8_ds_mla_v4_bf16_round, _fp8_ds_mla_v4_e4m3_value
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_bf16, _sparse_mla_mma
from nsa_backend.reference import V4_DATA_BYTES, V4_HEAD_DIM

BLOCK_H = 16
# 16-key tiles over 8 warps keep the [16 x 512] fp32 accumulator, the query and one decoded key tile in
# registers (sm_120: 204 registers, no spill; 32-key tiles over 4 warps spilled 4.7 KB per thread).
BLOCK_K = 16
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _v4_attend_list(q, m_i, l_i, acc, cache_ptr, idx_ptr, n_keys, page_size, stride_page, n_slots, sm_scale,
                    BLOCK_K: tl.constexpr):
    """Online-softmax update of ``(m_i, l_i, acc)`` over the first ``n_keys`` slots at ``idx_ptr``."""
    o_d = tl.arange(0, 512)
    is_nope = o_d < 448
    for k0 in range(0, n_keys, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_keys
        slot = tl.load(idx_ptr + o_k, mask=m_k, other=-1).to(tl.int64)
        ok = m_k & (slot >= 0) & (slot < n_slots)
        slot = tl.where(ok, slot, 0)
        p_page = cache_ptr + (slot // page_size) * stride_page  # [BLOCK_K] page starts
        i_p = slot % page_size
        p_dat = p_page + i_p * 576
        m_nope = ok[:, None] & is_nope[None, :]
        code = tl.load(p_dat[:, None] + o_d[None, :], mask=m_nope, other=0).to(tl.uint32)  # [BLOCK_K, 512]
        sbyte = tl.load((p_page + page_size * 576 + i_p * 8)[:, None] + (o_d // 64)[None, :], mask=m_nope,
                        other=127).to(tl.uint32)
        # 2^(s - 127): normal fp32 bits for 1..254; 0 is the subnormal 2^-127, 255 NaN (as the unpack).
        sbits = tl.where(sbyte == 0, 0x400000, sbyte << 23)
        sbits = tl.where(sbyte == 255, 0x7FC00000, sbits)
        nope = _fp8_ds_mla_v4_bf16_round(_fp8_ds_mla_v4_e4m3_value(code) * sbits.to(tl.float32, bitcast=True))
        p_rope = (p_dat + 448).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(p_rope[:, None] + (o_d - 448)[None, :], mask=ok[:, None] & ~is_nope[None, :],
                       other=0.0).to(tl.float32)
        # every value is a bf16 already, so the cast below is exact (also in the interpreter, which truncates)
        k = tl.where(is_nope[None, :], nope, rope).to(tl.bfloat16)  # [BLOCK_K, 512]
        # _sparse_mla_mma: bf16 operands (fp32 ones in the interpreter, whose bf16 dot is wrong)
        s = _sparse_mla_mma(q, tl.trans(k)) * sm_scale  # [BLOCK_H, BLOCK_K] float32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no key yet keep m = -inf; shift by 0 so exp() gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _sparse_mla_mma(_sparse_mla_bf16(p), k)
        m_i = m_new
    return m_i, l_i, acc


@triton.heuristics({
    "HAS_SINK": lambda args: args["sink_ptr"] is not None,
    "HAS_LEN": lambda args: args["len_ptr"] is not None,
    "HAS_EXTRA": lambda args: args["extra_idx_ptr"] is not None,
    "HAS_EXTRA_LEN": lambda args: args["extra_len_ptr"] is not None,
})
@triton.jit(do_not_specialize=["s_q", "h_q", "topk", "extra_topk", "page_size", "stride_page", "n_slots",
                               "extra_page_size", "extra_stride_page", "extra_n_slots"])
def _sparse_mla_v4_decode_kernel(
    q_ptr,  # [B, s_q, h_q, 512] bf16, contiguous
    cache_ptr,  # uint8 pages of [P x 576][P x 8] bytes, stride_page apart
    idx_ptr,  # [B, s_q, topk] int32 global slots of cache_ptr
    len_ptr,  # [B] int32 or None
    extra_cache_ptr,  # second cache (same format), or None
    extra_idx_ptr,  # [B, s_q, extra_topk] int32 global slots of extra_cache_ptr, or None
    extra_len_ptr,  # [B] int32 or None
    sink_ptr,  # [h_q] float32 or None
    out_ptr,  # [B, s_q, h_q, 512] bf16
    lse_ptr,  # [B, h_q, s_q] float32
    sm_scale,
    s_q,
    h_q,
    topk,
    extra_topk,
    page_size,
    stride_page,
    n_slots,
    extra_page_size,
    extra_stride_page,
    extra_n_slots,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * s_q + s
    b = row // s_q
    i_s = row % s_q
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_d = tl.arange(0, 512)
    p_q = q_ptr + (row * h_q + o_h)[:, None] * 512 + o_d[None, :]
    q = tl.load(p_q, mask=m_h[:, None], other=0.0)  # [BLOCK_H, 512] bf16
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    n_main = topk
    if HAS_LEN:
        n_main = tl.minimum(tl.load(len_ptr + b), topk)
    m_i, l_i, acc = _v4_attend_list(q, m_i, l_i, acc, cache_ptr, idx_ptr + row * topk, n_main, page_size,
                                    stride_page, n_slots, sm_scale, BLOCK_K)
    if HAS_EXTRA:
        n_extra = extra_topk
        if HAS_EXTRA_LEN:
            n_extra = tl.minimum(tl.load(extra_len_ptr + b), extra_topk)
        m_i, l_i, acc = _v4_attend_list(q, m_i, l_i, acc, extra_cache_ptr, extra_idx_ptr + row * extra_topk,
                                        n_extra, extra_page_size, extra_stride_page, extra_n_slots, sm_scale,
                                        BLOCK_K)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.log(l_safe))
    out = acc / l_safe[:, None]
    if HAS_SINK:
        sink = tl.load(sink_ptr + o_h, mask=m_h, other=0.0)
        # exp(lse) / (exp(lse) + exp(sink)); +inf lse (no key) is zeroed below
        out = out * (1.0 / (1.0 + tl.exp(sink - lse)))[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    p_o = out_ptr + (row * h_q + o_h)[:, None] * 512 + o_d[None, :]
    tl.store(p_o, _fp8_ds_mla_v4_bf16_round(out).to(tl.bfloat16), mask=m_h[:, None])
    tl.store(lse_ptr + (b * h_q + o_h) * s_q + i_s, lse, mask=m_h)


def _pages(cache: torch.Tensor) -> tuple[int, int, int]:
    """``(page_size, stride_page, n_slots)`` of a validated 4-D ``[num_blocks, P, 1, 584]`` cache."""
    return cache.shape[1], cache.stride(0), cache.shape[0] * cache.shape[1]


def sparse_mla_v4_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla_v4",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    kv_scale_format: str | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`nsa_backend.sparse_mla_decode` for ``kv_format="fp8_ds_mla_v4"`` (inputs validated).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, s_q, h_q, 512]`` ``bfloat16``, contiguous.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, P, 1, 584]`` block-split V4 pages (``stride(0)`` may be padded).
    indices : torch.Tensor
        ``[B, s_q, topk]`` ``int32`` global slots of ``kv_cache``; ``-1`` / out-of-range skipped.
    sm_scale : float
        Softmax scale applied to ``q . k``.
    d_v : int
        Value head dim (512, the whole dequantised row).
    kv_format : str
        ``"fp8_ds_mla_v4"``.
    attn_sink : torch.Tensor, optional
        ``[h_q]`` ``float32``: ``out *= exp(lse) / (exp(lse) + exp(sink))``.
    topk_length : torch.Tensor, optional
        ``[B]`` ``int32``: request ``b`` uses its first ``topk_length[b]`` indices.
    kv_scale_format : str, optional
        ``None`` (the V4 scales are always powers of two).
    extra_kv_cache, extra_indices, extra_topk_length : torch.Tensor, optional
        The second cache ``uint8 [num_blocks2, P2, 1, 584]``, its slots ``[B, s_q, extra_topk]`` and
        lengths ``[B]``, attended to in the same softmax.

    Returns
    -------
    tuple of torch.Tensor
        ``out [B, s_q, h_q, 512] bfloat16`` and ``lse [B, h_q, s_q] float32`` (natural log, ``+inf``
        for rows without a key).
    """
    B, s_q, h_q, d_qk = q.shape
    assert d_qk == V4_HEAD_DIM and d_v == V4_HEAD_DIM and kv_cache.shape[-1] == V4_DATA_BYTES + 8
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=q.device)
    if B * s_q == 0:
        return out, lse
    page, stride_page, n_slots = _pages(kv_cache)
    has_extra = extra_indices is not None
    e_page, e_stride, e_slots = _pages(extra_kv_cache) if has_extra else (1, 0, 0)
    grid = (B * s_q, triton.cdiv(h_q, BLOCK_H))
    _sparse_mla_v4_decode_kernel[grid](
        q, kv_cache, indices, topk_length, extra_kv_cache if has_extra else None, extra_indices,
        extra_topk_length if has_extra else None, attn_sink, out, lse, float(sm_scale), s_q, h_q,
        indices.shape[-1], extra_indices.shape[-1] if has_extra else 0, page, stride_page, n_slots, e_page,
        e_stride, e_slots, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out, lse
