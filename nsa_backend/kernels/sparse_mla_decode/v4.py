"""Portable Triton sparse MLA decode over the DeepSeek-V4 cache ("fp8_ds_mla_v4", 584 bytes per token).

FlashMLA's DeepSeek-V4 ``flash_mla_with_kvcache`` contract: query row ``(b, s)`` attends, in one
softmax, to ``indices[b, s, :topk_length[b]]`` of ``kv_cache`` (the sliding window) and to
``extra_indices[b, s, :extra_topk_length[b]]`` of ``extra_kv_cache`` (the compressed tokens); both
caches are block-split pages ``[P x 576 data bytes][P x 8 UE8M0 scale bytes]`` with their own page
size. Keys are the dequantised 512-dim rows, exactly as :func:`nsa_backend.unpack_fp8_ds_mla_v4`
(``bf16(fp32(e4m3) * 2^(byte - 127))`` for the 448 latent values, the 64 bf16 rope values as stored);
``V`` is the same row. The softmax runs in float32 online over blocks of ``BLOCK_K`` keys.

One program handles one query row and ``BLOCK_H`` heads (16 or 32 by arch,
:func:`nsa_backend.configs.sparse_mla.v4_decode_tile`; extra rows are masked, so any ``h_q`` in 1..128 runs
without padded heads in memory) and any ``topk``. The 512
dims are handled as four groups of 128 (three latent groups with two scale bytes each, and the last 64
latent values beside the 64 rope values), as the V3.2 tile does with its four scale groups: four
``[BLOCK_H, 128]`` accumulators, each key group decoded right before its MMA. The e4m3 bytes are
decoded with Triton's e4m3 type from sm_89 on and with integer operations on sm_80 / sm_86 (no e4m3
type there), to the same numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend.configs.sparse_mla import V4DecodeTile, v4_decode_tile
from nsa_backend.kernels._arch import device_arch
from nsa_backend.kernels.sparse_mla_prefill.common import fp8_native
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_bf16, _sparse_mla_mma
from nsa_backend.reference import V4_DATA_BYTES, V4_HEAD_DIM


@triton.jit
def _v4_scale(p_sc, ok, G: tl.constexpr):
    """``2^(s - 127)`` of scale byte ``G`` of the keys (``[BLOCK_K]`` float32): fp32 bits ``s << 23`` for
    1..254, the subnormal ``2^-127`` for 0 and NaN for 255, as :func:`nsa_backend.unpack_fp8_ds_mla_v4`."""
    s = tl.load(p_sc + G, mask=ok, other=127).to(tl.uint32)
    bits = tl.where(s == 0, 0x400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _v4_e4m3(raw, FP8_NATIVE: tl.constexpr):
    """float32 values of e4m3 (fn) bytes ``raw`` (uint8; 0x7F / 0xFF are NaN)."""
    if FP8_NATIVE:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # e4m3 bits -> fp16 bits of value * 2^-8, exact for every e4m3 value but the NaN code
        u = raw.to(tl.uint16)
        x = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((u & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def _v4_group(p_dat, p_sc, ok, G: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Dims ``[128 G, 128 G + 128)`` of the keys at ``p_dat`` as bf16 ``[BLOCK_K, 128]``: the latent values
    ``bf16(e4m3 * 2^(s - 127))`` (two scale bytes per group) and, for ``G = 3``, the 64 bf16 rope values as
    stored in the upper half. Keys outside ``ok`` read as zeros."""
    o_c = tl.arange(0, 128)
    lo = o_c < 64
    if G < 3:
        m_lat = ok[:, None]
        factor = tl.where(lo[None, :], _v4_scale(p_sc, ok, 2 * G)[:, None], _v4_scale(p_sc, ok, 2 * G + 1)[:, None])
    else:
        m_lat = ok[:, None] & lo[None, :]
        factor = _v4_scale(p_sc, ok, 6)[:, None]
    raw = tl.load(p_dat[:, None] + (G * 128 + o_c)[None, :], mask=m_lat, other=0)
    k = _sparse_mla_bf16(_v4_e4m3(raw, FP8_NATIVE) * factor)
    if G == 3:
        p_rope = (p_dat + 448).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(p_rope[:, None] + (o_c - 64)[None, :], mask=ok[:, None] & ~lo[None, :], other=0.0)
        k = tl.where(lo[None, :], k, rope)
    return k


@triton.jit
def _v4_attend_list(q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, cache_ptr, idx_ptr, n_keys, page_size,
                    stride_page, n_slots, sm_scale, BLOCK_K: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Online-softmax update of ``(m_i, l_i, acc0..3)`` over the first ``n_keys`` slots at ``idx_ptr``."""
    for k0 in range(0, n_keys, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_keys
        slot = tl.load(idx_ptr + o_k, mask=m_k, other=-1).to(tl.int64)
        ok = m_k & (slot >= 0) & (slot < n_slots)
        slot = tl.where(ok, slot, 0)
        p_page = cache_ptr + (slot // page_size) * stride_page  # [BLOCK_K] page starts
        i_p = slot % page_size
        p_dat = p_page + i_p * 576
        p_sc = p_page + page_size * 576 + i_p * 8
        # each group decoded right before its MMA, so one decoded group at a time is live beside the
        # accumulators; _sparse_mla_mma: bf16 operands (fp32 ones in the interpreter, whose bf16 dot is wrong)
        k_0 = _v4_group(p_dat, p_sc, ok, 0, FP8_NATIVE)
        s = _sparse_mla_mma(q0, tl.trans(k_0))  # [BLOCK_H, BLOCK_K] float32
        k_1 = _v4_group(p_dat, p_sc, ok, 1, FP8_NATIVE)
        s += _sparse_mla_mma(q1, tl.trans(k_1))
        k_2 = _v4_group(p_dat, p_sc, ok, 2, FP8_NATIVE)
        s += _sparse_mla_mma(q2, tl.trans(k_2))
        k_3 = _v4_group(p_dat, p_sc, ok, 3, FP8_NATIVE)
        s += _sparse_mla_mma(q3, tl.trans(k_3))
        s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no key yet keep m = -inf; shift by 0 so exp() gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = _sparse_mla_bf16(p)
        acc0 = acc0 * alpha[:, None] + _sparse_mla_mma(p16, k_0)
        acc1 = acc1 * alpha[:, None] + _sparse_mla_mma(p16, k_1)
        acc2 = acc2 * alpha[:, None] + _sparse_mla_mma(p16, k_2)
        acc3 = acc3 * alpha[:, None] + _sparse_mla_mma(p16, k_3)
        m_i = m_new
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _v4_store_group(out_ptr, row, h_q, o_h, m_h, acc, scale, G: tl.constexpr):
    """Write ``acc * scale`` ([BLOCK_H, 128], dims ``[128 G, 128 G + 128)``) as bf16, rounded to nearest even."""
    o_c = G * 128 + tl.arange(0, 128)
    p_o = out_ptr + (row * h_q + o_h)[:, None] * 512 + o_c[None, :]
    tl.store(p_o, _sparse_mla_bf16(acc * scale[:, None]), mask=m_h[:, None])


@triton.heuristics({
    "HAS_SINK": lambda args: args["sink_ptr"] is not None,
    "HAS_LEN": lambda args: args["len_ptr"] is not None,
    "HAS_EXTRA": lambda args: args["extra_idx_ptr"] is not None,
    "HAS_EXTRA_LEN": lambda args: args["extra_len_ptr"] is not None,
})
# The page strides are specialised (multiples of 16 bytes give vectorised key loads; a cache whose pages are
# not 16-byte aligned compiles its own variant with narrower loads).
@triton.jit(do_not_specialize=["s_q", "h_q", "topk", "extra_topk", "page_size", "n_slots", "extra_page_size",
                               "extra_n_slots"])
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
    FP8_NATIVE: tl.constexpr,
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
    o_c = tl.arange(0, 128)
    p_q = q_ptr + (row * h_q + o_h)[:, None] * 512 + o_c[None, :]
    # [BLOCK_H, 128] bf16 x 4
    q0 = tl.load(p_q, mask=m_h[:, None], other=0.0)
    q1 = tl.load(p_q + 128, mask=m_h[:, None], other=0.0)
    q2 = tl.load(p_q + 256, mask=m_h[:, None], other=0.0)
    q3 = tl.load(p_q + 384, mask=m_h[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    n_main = topk
    if HAS_LEN:
        n_main = tl.minimum(tl.load(len_ptr + b), topk)
    m_i, l_i, acc0, acc1, acc2, acc3 = _v4_attend_list(
        q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, cache_ptr, idx_ptr + row * topk, n_main, page_size,
        stride_page, n_slots, sm_scale, BLOCK_K, FP8_NATIVE)
    if HAS_EXTRA:
        n_extra = extra_topk
        if HAS_EXTRA_LEN:
            n_extra = tl.minimum(tl.load(extra_len_ptr + b), extra_topk)
        m_i, l_i, acc0, acc1, acc2, acc3 = _v4_attend_list(
            q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, extra_cache_ptr, extra_idx_ptr + row * extra_topk,
            n_extra, extra_page_size, extra_stride_page, extra_n_slots, sm_scale, BLOCK_K, FP8_NATIVE)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.log(l_safe))
    scale = 1.0 / l_safe
    if HAS_SINK:
        sink = tl.load(sink_ptr + o_h, mask=m_h, other=0.0)
        # exp(lse) / (exp(lse) + exp(sink)); +inf lse (no key) is zeroed below
        scale = scale * (1.0 / (1.0 + tl.exp(sink - lse)))
    scale = tl.where(empty, 0.0, scale)
    _v4_store_group(out_ptr, row, h_q, o_h, m_h, acc0, scale, 0)
    _v4_store_group(out_ptr, row, h_q, o_h, m_h, acc1, scale, 1)
    _v4_store_group(out_ptr, row, h_q, o_h, m_h, acc2, scale, 2)
    _v4_store_group(out_ptr, row, h_q, o_h, m_h, acc3, scale, 3)
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
    *,
    native_fp8: bool | None = None,
    tile: V4DecodeTile | None = None,
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
    native_fp8 : bool, optional
        Decode the e4m3 bytes with Triton's e4m3 type (the default from sm_89 on) or with integer
        operations (sm_80 / sm_86); the same numbers either way.
    tile : V4DecodeTile, optional
        Heads and keys per program, warps and stages, overriding the arch's
        (:func:`nsa_backend.configs.sparse_mla.v4_decode_tile`).

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
    arch = device_arch(q.device)
    if native_fp8 is None:
        native_fp8 = fp8_native(arch)
    tile = tile or v4_decode_tile(arch)
    grid = (B * s_q, triton.cdiv(h_q, tile.block_h))
    _sparse_mla_v4_decode_kernel[grid](
        q, kv_cache, indices, topk_length, extra_kv_cache if has_extra else None, extra_indices,
        extra_topk_length if has_extra else None, attn_sink, out, lse, float(sm_scale), s_q, h_q,
        indices.shape[-1], extra_indices.shape[-1] if has_extra else 0, page, stride_page, n_slots, e_page,
        e_stride, e_slots, BLOCK_H=tile.block_h, BLOCK_K=tile.block_k, FP8_NATIVE=native_fp8,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out, lse
