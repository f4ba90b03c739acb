"""FP8 packing of the sparse-MLA KV cache ("fp8_ds_mla", 656 bytes per token).

Token layout: bytes [0, 512) hold the 512 latent values as e4m3, [512, 528) four fp32 scales (one
per 128 values), [528, 656) the 64 rope values as bf16 (not quantised). Scales are either
``"arbitrary"`` (``amax / 448``, GLM-5 writers) or ``"pow2"`` (rounded up to a power of two,
DeepSeek writers); both decode the same way.
"""

from __future__ import annotations

import torch

from nsa_backend._checks import check_choice, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl
from nsa_backend.reference import DS_MLA_TOKEN_BYTES

SCALE_FORMATS = ("arbitrary", "pow2")
D_QK = 576


@custom_op("nsa_backend::pack_fp8_ds_mla", mutates_args=())
def _pack_op(kv: torch.Tensor, scale_format: str, impl: str) -> torch.Tensor:
    return get_impl("pack_fp8_ds_mla", impl)(kv, scale_format)


@_pack_op.register_fake
def _(kv, scale_format, impl):
    return kv.new_empty((kv.shape[0], DS_MLA_TOKEN_BYTES), dtype=torch.uint8)


def pack_fp8_ds_mla(kv: torch.Tensor, scale_format: str = "arbitrary", *, impl: str = "auto") -> torch.Tensor:
    """Quantise latent+rope KV rows into the 656-byte "fp8_ds_mla" token layout.

    Parameters
    ----------
    kv : torch.Tensor
        ``[N, 576]`` ``bfloat16`` (512 latent + 64 rope).
    scale_format : str
        ``"arbitrary"`` (``scale = max(amax, 1e-4) / 448``) or ``"pow2"`` (that rounded up to a power of two).

    Returns
    -------
    torch.Tensor
        ``[N, 656]`` ``uint8``.
    """
    check_tensor(kv, "kv", dtype=torch.bfloat16, shape=(None, D_QK))
    check_choice(scale_format, "scale_format", SCALE_FORMATS)
    name = resolve_impl("pack_fp8_ds_mla", impl, {"device": kv.device})
    return _pack_op(kv.contiguous(), scale_format, name)


@custom_op("nsa_backend::unpack_fp8_ds_mla", mutates_args=())
def _unpack_op(packed: torch.Tensor, impl: str) -> torch.Tensor:
    return get_impl("unpack_fp8_ds_mla", impl)(packed)


@_unpack_op.register_fake
def _(packed, impl):
    return packed.new_empty((*packed.shape[:-1], D_QK), dtype=torch.bfloat16)


def unpack_fp8_ds_mla(packed: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Dequantise "fp8_ds_mla" tokens back to ``bfloat16``.

    Parameters
    ----------
    packed : torch.Tensor
        ``uint8`` ``[..., 656]`` (e.g. ``[N, 656]`` or a whole ``[num_blocks, page, 1, 656]`` cache).

    Returns
    -------
    torch.Tensor
        ``bfloat16`` ``[..., 576]``.
    """
    check_tensor(packed, "packed", dtype=torch.uint8, ndim=(2, 3, 4))
    if packed.shape[-1] != DS_MLA_TOKEN_BYTES:
        raise ValueError(f"packed: expected the last dimension to be {DS_MLA_TOKEN_BYTES} bytes, "
                         f"got shape {tuple(packed.shape)}")
    name = resolve_impl("unpack_fp8_ds_mla", impl, {"device": packed.device})
    shape = packed.shape
    flat = _unpack_op(packed.contiguous().view(-1, DS_MLA_TOKEN_BYTES), name)
    return flat.view(*shape[:-1], D_QK)


@custom_op("nsa_backend::write_fp8_ds_mla_cache", mutates_args=("kv_cache",))
def _write_op(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_format: str,
              impl: str) -> None:
    get_impl("write_fp8_ds_mla_cache", impl)(kv, kv_cache, slot_mapping, scale_format)


@_write_op.register_fake
def _(kv, kv_cache, slot_mapping, scale_format, impl):
    return None


def write_fp8_ds_mla_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_format: str = "arbitrary",
    *,
    impl: str = "auto",
) -> None:
    """Quantise new tokens and store them into a paged "fp8_ds_mla" cache (in place).

    Parameters
    ----------
    kv : torch.Tensor
        ``[T, 576]`` ``bfloat16`` new tokens.
    kv_cache : torch.Tensor
        ``uint8`` ``[num_blocks, page_size, 656]`` or ``[num_blocks, page_size, 1, 656]``; each page
        contiguous, pages may be spaced apart.
    slot_mapping : torch.Tensor
        ``[T]`` ``int32`` or ``int64`` global slots; negative or out-of-range slots are skipped.
    scale_format : str
        ``"arbitrary"`` or ``"pow2"``; the bytes written equal :func:`pack_fp8_ds_mla`'s.
    """
    dims: dict[str, int] = {}
    check_tensor(kv, "kv", dtype=torch.bfloat16, shape=("T", D_QK), dims=dims)
    dev = kv.device
    check_tensor(kv_cache, "kv_cache", dtype=torch.uint8, ndim=(3, 4), device=dev)
    if kv_cache.shape[-1] != DS_MLA_TOKEN_BYTES or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"kv_cache: expected shape [num_blocks, page_size, (1,) {DS_MLA_TOKEN_BYTES}], "
                         f"got {tuple(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if kv_cache.stride(-1) != 1 or kv_cache.stride(1) != DS_MLA_TOKEN_BYTES \
            or kv_cache.stride(0) < page * DS_MLA_TOKEN_BYTES:
        raise ValueError(f"kv_cache: expected each page to be contiguous, got strides {tuple(kv_cache.stride())}")
    check_tensor(slot_mapping, "slot_mapping", dtype=(torch.int32, torch.int64), shape=("T",), dims=dims, device=dev)
    check_choice(scale_format, "scale_format", SCALE_FORMATS)
    name = resolve_impl("write_fp8_ds_mla_cache", impl, {"device": dev})
    _write_op(kv.contiguous(), kv_cache, slot_mapping.contiguous(), scale_format, name)
