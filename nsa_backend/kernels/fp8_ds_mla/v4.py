"""Triton kernels of the DeepSeek-V4 KV cache ("fp8_ds_mla_v4", 584 bytes per token).

Token: bytes ``[0, 448)`` the 448 latent values as e4m3, ``[448, 576)`` the 64 rope values as bf16,
then 7 UE8M0 scale bytes (one per 64 latent values) and one zero pad byte. A page of ``P`` tokens is
block-split: ``[P x 576 data bytes][P x 8 scale bytes]``. Per token and 64-wide group:

    x     = bf16(rms_norm(kv) * weight)            (optional)
    rope  = bf16(gptj_rotate(x[448:], cos, sin))   (optional)
    scale = 2 ** ceil(log2(max(amax, 1e-4) / 448)) (exact, from the fp32 bits of the quotient)
    byte  = e4m3(clamp(x / scale, -448, 448)),  scale byte = log2(scale) + 127

The e4m3 bytes are produced with integer arithmetic (as in :mod:`nsa_backend.kernels.fp8_ds_mla.v32`) and
read back the same way, so both kernels compile for every architecture (sm_80 / sm_86 have no e4m3
type in Triton) and match :mod:`nsa_backend.reference` byte for byte. Launches turn off fused
multiply-add, and the sum of squares of the norm is taken in float64 (exact squares; the result does
not depend on the reduction order), so the GPU rounds like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend.kernels.fp8_ds_mla.v32 import _fp8_ds_mla_e4m3_bits
from nsa_backend.reference import V4_HEAD_DIM, V4_TOKEN_BYTES

V4_NUM_WARPS = 4


@triton.jit
def _fp8_ds_mla_v4_bf16_round(x):
    """float32 ``x`` rounded to the nearest bf16 (ties to even), as float32. Integer arithmetic: the
    Triton interpreter's ``.to(tl.bfloat16)`` truncates, the GPU rounds to nearest; this is both."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.heuristics({
    "HAS_SLOTS": lambda args: args["slot_ptr"] is not None,
    "HAS_NORM": lambda args: args["w_ptr"] is not None,
    "HAS_ROPE": lambda args: args["cs_ptr"] is not None,
})
@triton.jit(do_not_specialize=["n_slots", "page_size", "stride_page", "n_pos", "eps"])
def _fp8_ds_mla_v4_write_kernel(
    kv_ptr,  # [T, 512] bf16
    out_ptr,  # uint8 cache: pages of [P x 576][P x 8] bytes, stride_page apart
    slot_ptr,  # [T] int32/int64 global slots, or None (token t -> page t of size 1)
    w_ptr,  # [512] norm weight, or None (no RMSNorm)
    pos_ptr,  # [T] int32/int64 positions (with cs_ptr)
    cs_ptr,  # [n_pos, 64] cos | sin, or None (no rope)
    n_slots,
    page_size,
    stride_kv,
    stride_page,
    stride_cs,
    n_pos,
    eps,
    HAS_SLOTS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + i_t).to(tl.int64)
    else:
        slot = i_t
    ok = (slot >= 0) & (slot < n_slots)
    pos = 0
    if HAS_ROPE:
        pos = tl.load(pos_ptr + i_t).to(tl.int64)
        ok = ok & (pos >= 0) & (pos < n_pos)
    if ok:
        o_g = tl.arange(0, 8)
        o_c = tl.arange(0, 64)
        o_h = tl.arange(0, 32)
        m_g = o_g < 7
        o_n = o_g[:, None] * 64 + o_c[None, :]  # [8, 64] latent offsets (row 7 masked)
        p_row = kv_ptr + i_t * stride_kv
        b_x = tl.load(p_row + o_n, mask=m_g[:, None], other=0.0).to(tl.float32)  # [8, 64]
        b_e = tl.load(p_row + 448 + 2 * o_h).to(tl.float32)  # [32] even rope dims
        b_o = tl.load(p_row + 449 + 2 * o_h).to(tl.float32)  # [32] odd rope dims
        if HAS_NORM:
            x64 = b_x.to(tl.float64)
            e64 = b_e.to(tl.float64)
            d64 = b_o.to(tl.float64)
            ss = tl.sum(tl.sum(x64 * x64, axis=1), axis=0) + tl.sum(e64 * e64, axis=0) + tl.sum(d64 * d64, axis=0)
            ms = (ss / 512.0).to(tl.float32)
            b_v = tl.full([1], 0.0, tl.float32) + ms + eps  # [1]
            b_rms = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.math.sqrt_rn(b_v))
            rms = tl.sum(b_rms, axis=0)
            b_wn = tl.load(w_ptr + o_n, mask=m_g[:, None], other=0.0).to(tl.float32)
            b_we = tl.load(w_ptr + 448 + 2 * o_h).to(tl.float32)
            b_wo = tl.load(w_ptr + 449 + 2 * o_h).to(tl.float32)
            b_x = _fp8_ds_mla_v4_bf16_round(b_x * rms * b_wn)
            b_e = _fp8_ds_mla_v4_bf16_round(b_e * rms * b_we)
            b_o = _fp8_ds_mla_v4_bf16_round(b_o * rms * b_wo)
        if HAS_ROPE:
            p_cs = cs_ptr + pos * stride_cs
            b_cos = tl.load(p_cs + o_h).to(tl.float32)
            b_sin = tl.load(p_cs + 32 + o_h).to(tl.float32)
            r_e = b_e * b_cos - b_o * b_sin
            r_o = b_e * b_sin + b_o * b_cos
            b_e = _fp8_ds_mla_v4_bf16_round(r_e)
            b_o = _fp8_ds_mla_v4_bf16_round(r_o)
        # UE8M0 scale per 64 values: the fp32 quotient rounded up to a power of two, exactly.
        b_amax = tl.max(tl.abs(b_x), axis=1)  # [8]
        b_q = tl.math.div_rn(tl.maximum(b_amax, 1e-4), tl.full([8], 448.0, tl.float32))
        qbits = b_q.to(tl.uint32, bitcast=True)
        b_code = (qbits >> 23) + ((qbits & 0x7FFFFF) != 0).to(tl.uint32)  # biased exponent of the scale
        b_scale = (b_code << 23).to(tl.float32, bitcast=True)
        b_y = tl.math.div_rn(b_x, tl.broadcast_to(b_scale[:, None], [8, 64]))
        b_y = tl.minimum(tl.maximum(b_y, -448.0), 448.0)
        b_fp8 = _fp8_ds_mla_e4m3_bits(b_y).to(tl.uint8)
        p_page = out_ptr + (slot // page_size) * stride_page
        i_p = slot % page_size
        p_dat = p_page + i_p * 576
        tl.store(p_dat + o_n, b_fp8, mask=m_g[:, None])
        p_rope = (p_dat + 448).to(tl.pointer_type(tl.bfloat16))
        # b_e / b_o hold bf16 values (inputs, or rounded above): the conversion is exact.
        tl.store(p_rope + 2 * o_h, b_e.to(tl.bfloat16))
        tl.store(p_rope + 2 * o_h + 1, b_o.to(tl.bfloat16))
        b_sbytes = tl.where(m_g, b_code, 0).to(tl.uint8)  # 7 scales and the zero pad byte
        tl.store(p_page + page_size * 576 + i_p * 8 + o_g, b_sbytes)


@triton.jit
def _fp8_ds_mla_v4_e4m3_value(code):
    """float32 value of e4m3 (fn) bytes given as uint32 (0x7F / 0xFF are NaN)."""
    sign = (code >> 7) & 1
    exp = (code >> 3) & 15
    man = code & 7
    normal = ((exp + 120) << 23 | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # exponent 0: man * 2^-9
    a = tl.where(exp == 0, sub, normal)
    a = tl.where((exp == 15) & (man == 7), float("nan"), a)
    # the sign goes in as a bit, so -0.0 stays -0.0 (Triton 3.4's interpreter negates 0.0 to +0.0)
    return (a.to(tl.uint32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["page_size", "stride_page"])
def _fp8_ds_mla_v4_unpack_kernel(
    cache_ptr,  # uint8 pages of [P x 576][P x 8] bytes, stride_page apart
    out_ptr,  # [num_blocks * P, 512] bf16, token order
    page_size,
    stride_page,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_g = tl.arange(0, 8)
    o_c = tl.arange(0, 64)
    o_r = tl.arange(0, 64)
    m_g = o_g < 7
    o_n = o_g[:, None] * 64 + o_c[None, :]
    p_page = cache_ptr + (i_t // page_size) * stride_page
    i_p = i_t % page_size
    p_dat = p_page + i_p * 576
    b_code = tl.load(p_dat + o_n, mask=m_g[:, None], other=0).to(tl.uint32)  # [8, 64]
    b_s = tl.load(p_page + page_size * 576 + i_p * 8 + o_g, mask=m_g, other=127).to(tl.uint32)  # [8]
    # 2^(s - 127): normal fp32 bits for 1..254; 0 is the subnormal 2^-127, 255 NaN.
    sbits = tl.where(b_s == 0, 0x400000, b_s << 23)
    sbits = tl.where(b_s == 255, 0x7FC00000, sbits)
    b_scale = sbits.to(tl.float32, bitcast=True)
    b_v = _fp8_ds_mla_v4_e4m3_value(b_code) * tl.broadcast_to(b_scale[:, None], [8, 64])
    p_out = out_ptr + i_t * 512
    tl.store(p_out + o_n, b_v.to(tl.bfloat16), mask=m_g[:, None])
    b_rope = tl.load((p_dat + 448).to(tl.pointer_type(tl.bfloat16)) + o_r)
    tl.store(p_out + 448 + o_r, b_rope)


def _launch_write(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor | None, n_slots: int, page: int,
                  stride_page: int, norm_weight: torch.Tensor | None, positions: torch.Tensor | None,
                  cos_sin_cache: torch.Tensor | None, eps: float) -> None:
    T = kv.shape[0]
    if T == 0:
        return
    has_rope = cos_sin_cache is not None
    _fp8_ds_mla_v4_write_kernel[(T,)](
        kv, cache, slots, norm_weight, positions if has_rope else None, cos_sin_cache,
        n_slots, page, kv.stride(0), stride_page,
        cos_sin_cache.stride(0) if has_rope else 0, cos_sin_cache.shape[0] if has_rope else 0, float(eps),
        num_warps=V4_NUM_WARPS,
        # Separate roundings of every product, as in the reference (a fused a*b - c*d rounds once).
        enable_fp_fusion=False,
    )


def pack_fp8_ds_mla_v4_triton(kv: torch.Tensor) -> torch.Tensor:
    """Triton :func:`nsa_backend.pack_fp8_ds_mla_v4`.

    Parameters
    ----------
    kv : torch.Tensor
        ``[N, 512]`` ``bfloat16``: 448 latent values then 64 rope values.

    Returns
    -------
    torch.Tensor
        ``[N, 584]`` ``uint8``: per token its 576 data bytes then its 8 scale bytes.
    """
    N = kv.shape[0]
    out = torch.empty(N, V4_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    _launch_write(kv, out, None, N, 1, V4_TOKEN_BYTES, None, None, None, 0.0)
    return out


def unpack_fp8_ds_mla_v4_triton(packed: torch.Tensor) -> torch.Tensor:
    """Triton :func:`nsa_backend.unpack_fp8_ds_mla_v4`.

    Parameters
    ----------
    packed : torch.Tensor
        ``uint8`` ``[N, 584]`` single tokens, or a cache ``[num_blocks, P, 584]`` /
        ``[num_blocks, P, 1, 584]`` of block-split pages (``stride(0)`` may be padded).

    Returns
    -------
    torch.Tensor
        ``bfloat16`` ``[..., 512]``, tokens in order.
    """
    if packed.dim() == 2:
        n_pages, page, stride_page = packed.shape[0], 1, packed.stride(0)
    else:
        n_pages, page, stride_page = packed.shape[0], packed.shape[1], packed.stride(0)
    T = n_pages * page
    out = torch.empty(T, V4_HEAD_DIM, dtype=torch.bfloat16, device=packed.device)
    if T:
        _fp8_ds_mla_v4_unpack_kernel[(T,)](packed, out, page, stride_page, num_warps=V4_NUM_WARPS)
    return out.view(*packed.shape[:-1], V4_HEAD_DIM)


def write_fp8_ds_mla_v4_cache_triton(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Triton :func:`nsa_backend.write_fp8_ds_mla_v4_cache`: normalise, rotate, quantise and store.

    Parameters
    ----------
    kv : torch.Tensor
        ``[T, 512]`` ``bfloat16``.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, P, 584]`` or ``[num_blocks, P, 1, 584]``, written in place; ``stride(0)``
        may be padded.
    slot_mapping : torch.Tensor
        ``[T]`` ``int32`` or ``int64``; negative and out-of-range slots are skipped.
    norm_weight : torch.Tensor, optional
        ``[512]`` RMSNorm weight; ``None`` skips the norm.
    positions : torch.Tensor, optional
        ``[T]`` ``int32`` / ``int64`` rows of ``cos_sin_cache`` (tokens outside it are skipped).
    cos_sin_cache : torch.Tensor, optional
        ``[max_pos, 64]`` (``[cos(32) | sin(32)]``); ``None`` skips the rotation.
    eps : float
        RMSNorm epsilon.
    """
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    _launch_write(kv, kv_cache, slot_mapping, num_blocks * page, page, kv_cache.stride(0), norm_weight, positions,
                  cos_sin_cache, eps)
