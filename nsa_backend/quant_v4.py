"""DeepSeek-V4 KV cache ("fp8_ds_mla_v4", 584 bytes per token): packing, unpacking and the cache write.

Token: bytes ``[0, 448)`` hold the 448 latent ("nope") values as e4m3, ``[448, 576)`` the 64 rope
values as bf16 (not quantised), then 7 UE8M0 scale bytes (``2 ** (byte - 127)``, one per 64 latent
values) and one zero pad byte. A page of ``P`` tokens is block-split: the ``P`` 576-byte data rows
first, then the ``P`` 8-byte scale rows (FlashMLA's DeepSeek-V4 layout, SGLang ``KVLayout.V4``,
vLLM's ``fp8_ds_mla`` cache of DeepseekV4). Scales are powers of two:
``2 ** ceil(log2(max(amax, 1e-4) / 448))``.

The names follow this package's ``fp8_ds_mla`` ops with a ``_v4`` suffix: vLLM calls both cache
formats ``fp8_ds_mla`` and SGLang calls the V4 one ``V4``, so the suffix keeps them apart.
"""

from __future__ import annotations

import torch

from nsa_backend._checks import check_float, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl
from nsa_backend.reference import V4_HEAD_DIM, V4_ROPE_DIM, V4_TOKEN_BYTES


@custom_op("nsa_backend::pack_fp8_ds_mla_v4", mutates_args=())
def _pack_op(kv: torch.Tensor, impl: str) -> torch.Tensor:
    return get_impl("pack_fp8_ds_mla_v4", impl)(kv)


@_pack_op.register_fake
def _(kv, impl):
    return kv.new_empty((kv.shape[0], V4_TOKEN_BYTES), dtype=torch.uint8)


def pack_fp8_ds_mla_v4(kv: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Quantise latent+rope rows into 584-byte DeepSeek-V4 tokens (no norm, no rotation).

    Parameters
    ----------
    kv : torch.Tensor
        ``[N, 512]`` ``bfloat16`` (448 latent + 64 rope).

    Returns
    -------
    torch.Tensor
        ``[N, 584]`` ``uint8``: per token its 576 data bytes then its 8 scale bytes (a cache of
        ``N`` pages of size 1).

    Examples
    --------
    >>> import torch, nsa_backend as nb
    >>> nb.pack_fp8_ds_mla_v4(torch.zeros(2, 512, dtype=torch.bfloat16)).shape
    torch.Size([2, 584])
    """
    check_tensor(kv, "kv", dtype=torch.bfloat16, shape=(None, V4_HEAD_DIM))
    name = resolve_impl("pack_fp8_ds_mla_v4", impl, {"device": kv.device})
    return _pack_op(kv.contiguous(), name)


@custom_op("nsa_backend::unpack_fp8_ds_mla_v4", mutates_args=())
def _unpack_op(packed: torch.Tensor, impl: str) -> torch.Tensor:
    _check_v4_address(packed, "packed")
    return get_impl("unpack_fp8_ds_mla_v4", impl)(packed)


@_unpack_op.register_fake
def _(packed, impl):
    return packed.new_empty((*packed.shape[:-1], V4_HEAD_DIM), dtype=torch.bfloat16)


def _check_v4_pages(x: torch.Tensor, name: str, ndim: tuple[int, ...], device: torch.device | None = None) -> None:
    """``x``: uint8 ``[num_blocks, P, (1,) 584]`` (or ``[N, 584]`` when 2 is in ``ndim``) whose pages
    are each contiguous, ``stride(0)`` even and at least a page."""
    check_tensor(x, name, dtype=torch.uint8, ndim=ndim, device=device)
    if x.shape[-1] != V4_TOKEN_BYTES or (x.dim() == 4 and x.shape[2] != 1):
        want = "[N, 584] or " if 2 in ndim else ""
        raise ValueError(f"{name}: expected shape {want}[num_blocks, page_size, (1,) {V4_TOKEN_BYTES}], "
                         f"got {tuple(x.shape)}")
    page = 1 if x.dim() == 2 else x.shape[1]
    if page < 1:
        raise ValueError(f"{name}: expected page_size (dim 1) >= 1, got {tuple(x.shape)}")
    inner = (1,) if x.dim() == 2 else ((V4_TOKEN_BYTES, 1) if x.dim() == 3 else (V4_TOKEN_BYTES, V4_TOKEN_BYTES, 1))
    strides = tuple(x.stride())[1:]
    # A page's bytes are addressed as one block ([P x 576][P x 8]): every page must be contiguous.
    if x.shape[0] > 0 and (any(s != w for s, w, n in zip(strides, inner, x.shape[1:]) if n > 1)
                           or (x.shape[0] > 1 and x.stride(0) < page * V4_TOKEN_BYTES)):
        raise ValueError(f"{name}: expected each page of {page} x {V4_TOKEN_BYTES} bytes to be contiguous, "
                         f"got shape {tuple(x.shape)} with strides {tuple(x.stride())}")
    # bf16 rope values are read and written in place: 2-byte alignment (the start address is checked
    # inside the op, where the tensor is real: torch.compile traces this function with fake tensors).
    if x.stride(0) % 2:
        raise ValueError(f"{name}: expected an even page stride (bf16 rope values), got stride(0)={x.stride(0)}")


def _check_v4_address(x: torch.Tensor, name: str) -> None:
    if x.data_ptr() % 2:
        raise ValueError(f"{name}: expected an even start address (bf16 rope values), got a view starting at an "
                         f"odd byte (storage_offset()={x.storage_offset()})")


def unpack_fp8_ds_mla_v4(packed: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Dequantise DeepSeek-V4 tokens back to ``bfloat16`` 512-dim rows.

    Each latent value is ``bf16(fp32(e4m3) * 2 ** (scale_byte - 127))`` (exact: a power-of-two
    scale); the rope values are copied.

    Parameters
    ----------
    packed : torch.Tensor
        ``uint8`` ``[N, 584]`` single tokens (as :func:`pack_fp8_ds_mla_v4` returns), or a paged cache
        ``[num_blocks, P, 584]`` / ``[num_blocks, P, 1, 584]`` of block-split pages (``stride(0)`` may
        be padded, as in SGLang's and vLLM's 576-byte aligned pages).

    Returns
    -------
    torch.Tensor
        ``bfloat16`` ``[..., 512]``: token ``t`` of page ``b`` at ``[b, t]``.
    """
    _check_v4_pages(packed, "packed", (2, 3, 4))
    name = resolve_impl("unpack_fp8_ds_mla_v4", impl, {"device": packed.device})
    return _unpack_op(packed, name)


@custom_op("nsa_backend::write_fp8_ds_mla_v4_cache", mutates_args=("kv_cache",))
def _write_op(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, norm_weight: torch.Tensor | None,
              positions: torch.Tensor | None, cos_sin_cache: torch.Tensor | None, eps: float, impl: str) -> None:
    _check_v4_address(kv_cache, "kv_cache")
    get_impl("write_fp8_ds_mla_v4_cache", impl)(kv, kv_cache, slot_mapping, norm_weight, positions, cos_sin_cache,
                                                eps)


@_write_op.register_fake
def _(kv, kv_cache, slot_mapping, norm_weight, positions, cos_sin_cache, eps, impl):
    return None


def write_fp8_ds_mla_v4_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    impl: str = "auto",
) -> None:
    """Normalise, rotate, quantise and store new DeepSeek-V4 KV rows into a paged cache (in place).

    Per token: ``x = bf16(rms_norm(kv) * norm_weight)`` (RMSNorm over all 512 dims, fp32, one rounding
    to bf16, as the frameworks' ``kv_norm`` stores it), then the interleaved (GPT-J) rotation of the
    last 64 dims by ``cos_sin_cache[positions]`` rounded to bf16, then the bytes of
    :func:`pack_fp8_ds_mla_v4` written to token ``slot % P`` of page ``slot // P``.

    Parameters
    ----------
    kv : torch.Tensor
        ``[T, 512]`` ``bfloat16`` latent rows (448 nope + 64 rope).
    kv_cache : torch.Tensor
        ``uint8`` ``[num_blocks, P, 584]`` or ``[num_blocks, P, 1, 584]`` (FlashMLA's k_cache shape),
        block-split pages ``[P x 576][P x 8]``; each page contiguous, ``stride(0)`` may be larger (a
        2-D framework buffer ``[num_pages, page_bytes]`` is passed as
        ``buf[:, :P * 584].view(num_pages, P, 584)``). Any ``P``; the frameworks use 64 and 256.
    slot_mapping : torch.Tensor
        ``[T]`` ``int32`` or ``int64`` global slots; negative (``-1``) or out-of-range slots are
        skipped (checking the range on the host would synchronise the GPU).
    norm_weight : torch.Tensor, optional
        ``[512]`` ``bfloat16`` or ``float32`` RMSNorm weight; ``None`` when ``kv`` is already normalised
        (vLLM fuses the norm with the query norm).
    positions : torch.Tensor, optional
        ``[T]`` ``int32`` or ``int64`` rows of ``cos_sin_cache``; required with it. Tokens whose
        position is outside the cache are skipped.
    cos_sin_cache : torch.Tensor, optional
        ``[max_pos, 64]`` ``float32`` or ``bfloat16``: ``[cos(32) | sin(32)]`` per position (vLLM's
        ``rotary_emb.cos_sin_cache``); ``None`` when ``kv`` is already rotated.
    eps : float
        RMSNorm epsilon (DeepSeek-V4: ``rms_norm_eps = 1e-6``).

    Examples
    --------
    >>> import torch, nsa_backend as nb
    >>> cache = torch.zeros(2, 64, 584, dtype=torch.uint8)
    >>> kv = torch.randn(3, 512).bfloat16()
    >>> nb.write_fp8_ds_mla_v4_cache(kv, cache, torch.tensor([0, -1, 70]), torch.ones(512),
    ...                              torch.tensor([0, 1, 2]), torch.randn(8, 64))
    """
    dims: dict[str, int] = {}
    check_tensor(kv, "kv", dtype=torch.bfloat16, shape=("T", V4_HEAD_DIM), dims=dims)
    dev = kv.device
    _check_v4_pages(kv_cache, "kv_cache", (3, 4), device=dev)
    check_tensor(slot_mapping, "slot_mapping", dtype=(torch.int32, torch.int64), shape=("T",), dims=dims, device=dev)
    if norm_weight is not None:
        check_tensor(norm_weight, "norm_weight", dtype=(torch.bfloat16, torch.float32), shape=(V4_HEAD_DIM,),
                     device=dev)
    if (positions is None) != (cos_sin_cache is None):
        raise ValueError("positions / cos_sin_cache: expected both (to rotate the rope dims) or neither, got "
                         f"positions={'a tensor' if positions is not None else None}, "
                         f"cos_sin_cache={'a tensor' if cos_sin_cache is not None else None}")
    if cos_sin_cache is not None:
        check_tensor(positions, "positions", dtype=(torch.int32, torch.int64), shape=("T",), dims=dims, device=dev)
        check_tensor(cos_sin_cache, "cos_sin_cache", dtype=(torch.float32, torch.bfloat16),
                     shape=(None, V4_ROPE_DIM), device=dev, last_dim_contiguous=True)
    eps = check_float(eps, "eps", positive=True)
    name = resolve_impl("write_fp8_ds_mla_v4_cache", impl, {"device": dev})
    _write_op(
        kv.contiguous(), kv_cache, slot_mapping.contiguous(),
        None if norm_weight is None else norm_weight.contiguous(),
        None if positions is None else positions.contiguous(),
        cos_sin_cache, eps, name,
    )
