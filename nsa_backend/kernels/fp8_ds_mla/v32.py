"""Triton packing of the "fp8_ds_mla" sparse-MLA KV cache (656 bytes per token).

Token layout: bytes ``[0, 512)`` hold the 512 latent values as e4m3, ``[512, 528)`` four fp32
scales (one per 128 values), ``[528, 656)`` the 64 rope values as bf16. Per 128-wide group:

    scale = max(amax, 1e-4) / 448                       ("arbitrary")
    scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))      ("pow2")
    byte  = e4m3(clamp(x / scale, -448, 448))           (round to nearest even)

The e4m3 byte is produced with integer arithmetic (no fp8 type), so one kernel compiles for every
architecture (sm_80 and sm_86 have no e4m3 type in Triton) and writes the same bytes as
:func:`nsa_backend.reference.pack_fp8_ds_mla`. The pow2 scale is derived from the fp32 bits of the
arbitrary scale, which equals ``2 ** ceil(log2(scale))`` exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend.reference import DS_MLA_TOKEN_BYTES

NOPE_DIM = 512
ROPE_DIM = 64
GROUP = 128
PACK_NUM_WARPS = 4


@triton.jit
def _fp8_ds_mla_e4m3_bits(x):
    """e4m3 (fn) bit pattern of fp32 ``x`` with ``|x| <= 448``, round to nearest even -> uint32."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.uint32, bitcast=True)
    # Normal range (a >= 2^-6): keep 3 mantissa bits with round-to-nearest-even, rebias 127 -> 7.
    rounded = abits + 0x7FFFF + ((abits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9, rounded to nearest even by the 2^23 addition.
    y = a * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal)
    return code | sign


@triton.heuristics({"HAS_SLOTS": lambda args: args["slot_ptr"] is not None})
@triton.jit(do_not_specialize=["n_slots", "page_size", "stride_page"])
def _fp8_ds_mla_pack_kernel(
    kv_ptr,  # [T, 576] bf16
    out_ptr,  # uint8 cache, token rows of 656 bytes inside pages
    slot_ptr,  # [T] int32/int64 global slots, or None (token t -> row t)
    n_slots,
    page_size,
    stride_kv,
    stride_page,
    POW2: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + i_t).to(tl.int64)
    else:
        slot = i_t
    if (slot >= 0) & (slot < n_slots):
        o_g = tl.arange(0, 4)
        o_c = tl.arange(0, 128)
        o_r = tl.arange(0, 64)
        p_row = kv_ptr + i_t * stride_kv
        # [4, 128]
        b_x = tl.load(p_row + o_g[:, None] * 128 + o_c[None, :]).to(tl.float32)
        b_amax = tl.max(tl.abs(b_x), axis=1)  # [4]
        b_scale = tl.math.div_rn(tl.maximum(b_amax, 1e-4), tl.full([4], 448.0, tl.float32))
        if POW2:
            sbits = b_scale.to(tl.uint32, bitcast=True)
            up = ((sbits & 0x7FFFFF) != 0).to(tl.uint32)
            b_scale = (((sbits >> 23) + up) << 23).to(tl.float32, bitcast=True)
        b_y = tl.math.div_rn(b_x, tl.broadcast_to(b_scale[:, None], [4, 128]))
        b_y = tl.minimum(tl.maximum(b_y, -448.0), 448.0)
        b_q = _fp8_ds_mla_e4m3_bits(b_y).to(tl.uint8)
        p_dst = out_ptr + (slot // page_size) * stride_page + (slot % page_size) * 656
        tl.store(p_dst + o_g[:, None] * 128 + o_c[None, :], b_q)
        tl.store((p_dst + 512).to(tl.pointer_type(tl.float32)) + o_g, b_scale)
        b_rope = tl.load(p_row + 512 + o_r)
        tl.store((p_dst + 528).to(tl.pointer_type(tl.bfloat16)) + o_r, b_rope)


def _launch(kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor | None, n_slots: int, page: int,
            stride_page: int, scale_format: str) -> None:
    T = kv.shape[0]
    if T == 0:
        return
    _fp8_ds_mla_pack_kernel[(T,)](
        kv, cache, slots, n_slots, page, kv.stride(0), stride_page,
        POW2=scale_format == "pow2", num_warps=PACK_NUM_WARPS,
    )


def pack_fp8_ds_mla_triton(kv: torch.Tensor, scale_format: str = "arbitrary") -> torch.Tensor:
    """Triton :func:`nsa_backend.pack_fp8_ds_mla`.

    Parameters
    ----------
    kv : torch.Tensor
        ``[N, 576]`` ``bfloat16``: 512 latent values then 64 rope values.
    scale_format : str
        ``"arbitrary"`` or ``"pow2"`` scales per 128-wide group.

    Returns
    -------
    torch.Tensor
        ``[N, 656]`` ``uint8`` fp8_ds_mla token rows.
    """
    N = kv.shape[0]
    out = torch.empty(N, DS_MLA_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    _launch(kv, out, None, N, 1, DS_MLA_TOKEN_BYTES, scale_format)
    return out


def write_fp8_ds_mla_cache_triton(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_format: str = "arbitrary",
) -> None:
    """Triton :func:`nsa_backend.write_fp8_ds_mla_cache`: quantise ``kv`` into ``slot_mapping`` slots.

    Parameters
    ----------
    kv : torch.Tensor
        ``[T, 576]`` ``bfloat16``.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, page, 656]`` or ``[num_blocks, page, 1, 656]``, written in place;
        ``stride(0)`` may be padded.
    slot_mapping : torch.Tensor
        ``[T]`` ``int32`` or ``int64``: token ``t`` goes to row ``slot % page`` of page ``slot // page``;
        negative slots are skipped.
    scale_format : str
        ``"arbitrary"`` or ``"pow2"``.
    """
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    _launch(kv, kv_cache, slot_mapping, num_blocks * page, page, kv_cache.stride(0), scale_format)
