"""Sparse MLA attention: prefill over a bf16 latent KV sequence and decode over a paged KV cache.

Signatures and semantics match FlashMLA's ``flash_mla_sparse_fwd`` (prefill) and its sparse
``flash_mla_with_kvcache`` path (decode). Dimensions: s_q query rows, h_q query heads (1..128),
d_qk 576 (512 latent + 64 rope) or 512, d_v 512, topk selected keys per row, B requests.

FP8 KV cache "fp8_ds_mla" (656 bytes per token): bytes [0, 512) hold 512 e4m3 latent values,
[512, 528) four fp32 scales (one per 128 values), [528, 656) the 64 bf16 rope values.

DeepSeek-V4 cache "fp8_ds_mla_v4" (584 bytes per token, d_qk 512 = 448 latent + 64 rope): block-split
pages ``[P x 576 data bytes][P x 8 UE8M0 scale bytes]`` (see :mod:`nsa_backend.quant_v4`). V4 decode
follows FlashMLA's ``flash_mla_with_kvcache``: the keys are ``indices[:topk_length]`` of ``kv_cache``
(the sliding window) and, optionally, ``extra_indices[:extra_topk_length]`` of a second cache
``extra_kv_cache`` in the same format (the compressed tokens), all in one softmax. V4 prefill is
:func:`flash_mla_sparse_fwd` with ``d_qk = 512`` over bf16 rows (the callers merge both index lists).
"""

from __future__ import annotations

import torch

from nsa_backend._checks import check_choice, check_float, check_int, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl
from nsa_backend._replay import ReplayCache
from nsa_backend.quant import SCALE_FORMATS
from nsa_backend.reference import DS_MLA_TOKEN_BYTES, V4_HEAD_DIM, V4_TOKEN_BYTES

D_QK_CHOICES = (512, 576)
D_V_CHOICES = (512,)
MAX_HEADS = 128
MAX_DECODE_S_Q = 16
KV_FORMATS = ("fp8_ds_mla", "bf16", "fp8_ds_mla_v4")
# Formats whose decode takes a second (extra) cache and index list, as FlashMLA's DeepSeek-V4 decode.
EXTRA_KV_FORMATS = ("fp8_ds_mla_v4",)
# Recorded eager decode calls (nsa_backend._replay).
_decode_replays = ReplayCache("sparse_mla_decode")


def _check_common(h_q: int, d_qk: int, d_v: int, topk: int) -> None:
    check_int(h_q, "q heads (h_q)", min_value=1, max_value=MAX_HEADS)
    check_int(d_qk, "q head dim (d_qk)", choices=D_QK_CHOICES)
    check_int(d_v, "d_v", choices=D_V_CHOICES)
    check_int(topk, "indices.shape[-1] (topk)", min_value=1)


def _check_sink_and_length(attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None, length_dim: str,
                           dims: dict[str, int], device: torch.device
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked, contiguous ``attn_sink [h_q] float32`` and ``topk_length [length_dim] int32`` (``None`` kept)."""
    if attn_sink is not None:
        check_tensor(attn_sink, "attn_sink", dtype=torch.float32, shape=("h_q",), dims=dims, device=device)
        attn_sink = attn_sink.contiguous()
    if topk_length is not None:
        check_tensor(topk_length, "topk_length", dtype=torch.int32, shape=(length_dim,), dims=dims, device=device)
        topk_length = topk_length.contiguous()
    return attn_sink, topk_length


@custom_op("nsa_backend::flash_mla_sparse_fwd", mutates_args=())
def _sparse_fwd_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                   attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                   impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, max_logits, lse = get_impl("flash_mla_sparse_fwd", impl)(q, kv, indices, sm_scale, d_v, attn_sink,
                                                                  topk_length)
    return out.contiguous(), max_logits.contiguous(), lse.contiguous()


@_sparse_fwd_op.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, impl):
    s_q, h_q, _ = q.shape
    return (q.new_empty((s_q, h_q, d_v), dtype=torch.bfloat16), q.new_empty((s_q, h_q), dtype=torch.float32),
            q.new_empty((s_q, h_q), dtype=torch.float32))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Sparse MLA prefill: every query row attends to its own ``topk`` selected keys.

    .. math::
        P = (q K_I^T) \cdot sm\_scale, \quad out = \text{softmax}(P) V_I, \quad lse = \log \sum e^{P}

    Parameters
    ----------
    q : torch.Tensor
        ``[s_q, h_q, d_qk]`` ``bfloat16``; ``h_q`` in 1..128, ``d_qk`` in {512, 576}.
    kv : torch.Tensor
        ``[s_kv, 1, d_qk]`` ``bfloat16`` (one latent head; ``[s_kv, d_qk]`` is accepted too).
        ``V`` is the first ``d_v`` dims.
    indices : torch.Tensor
        ``[s_q, 1, topk]`` ``int32`` (or ``[s_q, topk]``); ``-1`` and values ``>= s_kv`` are skipped.
    sm_scale : float
        Softmax scale applied to ``q . k``.
    d_v : int
        Value head dim (512).
    attn_sink : torch.Tensor, optional
        ``[h_q]`` ``float32``: ``out *= exp(lse) / (exp(lse) + exp(sink))``; ``lse`` unchanged.
    topk_length : torch.Tensor, optional
        ``[s_q]`` ``int32``: only the first ``topk_length[i]`` indices of row ``i`` count.

    Returns
    -------
    out : torch.Tensor
        ``[s_q, h_q, d_v]`` ``bfloat16``; zero for rows without a valid index.
    max_logits : torch.Tensor
        ``[s_q, h_q]`` ``float32``, the largest scaled logit (``-inf`` for empty rows).
    lse : torch.Tensor
        ``[s_q, h_q]`` ``float32`` natural-log sum-exp (``+inf`` for empty rows).
    """
    dims: dict[str, int] = {}
    check_tensor(q, "q", dtype=torch.bfloat16, shape=("s_q", "h_q", "d_qk"), dims=dims)
    dev = q.device
    check_tensor(kv, "kv", dtype=torch.bfloat16, ndim=(2, 3), device=dev)
    if kv.dim() == 2:
        kv = kv.unsqueeze(1)
    check_tensor(kv, "kv", shape=("s_kv", 1, "d_qk"), dims=dims)
    check_tensor(indices, "indices", dtype=torch.int32, ndim=(2, 3), device=dev)
    if indices.dim() == 2:
        indices = indices.unsqueeze(1)
    check_tensor(indices, "indices", shape=("s_q", 1, "topk"), dims=dims)
    check_float(sm_scale, "sm_scale", positive=True)
    _check_common(dims["h_q"], dims["d_qk"], d_v, dims["topk"])
    attn_sink, topk_length = _check_sink_and_length(attn_sink, topk_length, "s_q", dims, dev)
    name = resolve_impl("flash_mla_sparse_fwd", impl, {"device": dev, "num_heads": dims["h_q"], "d_qk": dims["d_qk"],
                                                       "topk": dims["topk"]})
    return _sparse_fwd_op(q.contiguous(), kv.contiguous(), indices.contiguous(), float(sm_scale), d_v, attn_sink,
                          topk_length, name)


@custom_op("nsa_backend::sparse_mla_decode", mutates_args=())
def _sparse_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                      kv_format: str, attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                      kv_scale_format: str | None, extra_kv_cache: torch.Tensor | None,
                      extra_indices: torch.Tensor | None, extra_topk_length: torch.Tensor | None,
                      impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kv_format in EXTRA_KV_FORMATS:
        # V4 implementations are their own functions (FlashMLA's two-list contract).
        out, lse = get_impl("sparse_mla_decode", impl, kv_format)(
            q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length, kv_scale_format,
            extra_kv_cache, extra_indices, extra_topk_length)
    else:
        out, lse = get_impl("sparse_mla_decode", impl)(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink,
                                                       topk_length, kv_scale_format)
    return out.contiguous(), lse.contiguous()


@_sparse_decode_op.register_fake
def _(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length, kv_scale_format, extra_kv_cache,
      extra_indices, extra_topk_length, impl):
    B, s_q, h_q, _ = q.shape
    return q.new_empty((B, s_q, h_q, d_v), dtype=torch.bfloat16), q.new_empty((B, h_q, s_q), dtype=torch.float32)


def _check_paged_cache(kv_cache: torch.Tensor, kv_format: str, d_qk: int, device: torch.device,
                       name: str = "kv_cache") -> torch.Tensor:
    """Validate a paged sparse-MLA cache and return its 4-D ``[num_blocks, page, 1, width]`` view."""
    if kv_format == "fp8_ds_mla_v4":
        check_tensor(kv_cache, name, dtype=torch.uint8, ndim=(3, 4), device=device)
        if kv_cache.dim() == 3:
            kv_cache = kv_cache.unsqueeze(2)
        if kv_cache.shape[2] != 1 or kv_cache.shape[3] != V4_TOKEN_BYTES:
            raise ValueError(f"{name}: expected fp8_ds_mla_v4 shape [num_blocks, page_size, (1,) "
                             f"{V4_TOKEN_BYTES}], got {tuple(kv_cache.shape)}")
        if d_qk != V4_HEAD_DIM:
            raise ValueError(f"q: kv_format 'fp8_ds_mla_v4' stores {V4_HEAD_DIM}-dim tokens, expected q head dim "
                             f"{V4_HEAD_DIM}, got {d_qk}")
        if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
            raise ValueError(f"{name}: expected at least one page of at least one token, got shape "
                             f"{tuple(kv_cache.shape)}")
    elif kv_format == "fp8_ds_mla":
        check_tensor(kv_cache, "kv_cache", dtype=torch.uint8, ndim=(3, 4), device=device)
        if kv_cache.dim() == 3:
            kv_cache = kv_cache.unsqueeze(2)
        if kv_cache.shape[2] != 1 or kv_cache.shape[3] != DS_MLA_TOKEN_BYTES:
            raise ValueError(f"kv_cache: expected fp8_ds_mla shape [num_blocks, page_size, (1,) "
                             f"{DS_MLA_TOKEN_BYTES}], got {tuple(kv_cache.shape)}")
        if d_qk != 576:
            raise ValueError(f"q: kv_format 'fp8_ds_mla' stores 576-dim tokens, expected q head dim 576, got {d_qk}")
    else:
        check_tensor(kv_cache, "kv_cache", dtype=torch.bfloat16, ndim=4, device=device)
        if kv_cache.shape[2] != 1 or kv_cache.shape[3] != d_qk:
            raise ValueError(f"kv_cache: expected bf16 shape [num_blocks, page_size, 1, d_qk={d_qk}], "
                             f"got {tuple(kv_cache.shape)}")
    width = kv_cache.shape[3]
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) < kv_cache.shape[1] * width:
        raise ValueError(f"{name}: expected each page to be contiguous (strides [>= page_size * {width}, {width}, "
                         f"*, 1]), got strides {tuple(kv_cache.stride())}")
    return kv_cache


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    kv_scale_format: str | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over a paged KV cache addressed by global slots.

    With ``kv_format="fp8_ds_mla_v4"`` (DeepSeek-V4, FlashMLA's ``flash_mla_with_kvcache`` contract)
    each query row attends, in one softmax, to ``indices[b, s, :topk_length[b]]`` of ``kv_cache`` and
    ``extra_indices[b, s, :extra_topk_length[b]]`` of ``extra_kv_cache``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, s_q, h_q, d_qk]`` ``bfloat16``; ``s_q`` in 1..16 (1, or 2-4 with MTP).
    kv_cache : torch.Tensor
        ``kv_format="fp8_ds_mla"``: ``uint8`` ``[num_blocks, page_size, 656]`` or
        ``[num_blocks, page_size, 1, 656]`` (needs ``d_qk = 576``). ``kv_format="fp8_ds_mla_v4"``:
        ``uint8`` ``[num_blocks, page_size, (1,) 584]``, block-split pages (needs ``d_qk = 512``; a
        framework's 2-D page buffer is passed as ``buf[:, :page_size * 584].view(-1, page_size, 584)``).
        ``kv_format="bf16"``: ``bfloat16`` ``[num_blocks, page_size, 1, d_qk]``. Pages may be spaced
        (``stride(0)``).
    indices : torch.Tensor
        ``[B, s_q, topk]`` ``int32`` global slots ``page * page_size + offset``; ``-1`` and
        out-of-range slots are skipped.
    sm_scale : float
        Softmax scale.
    d_v : int
        Value head dim (512).
    kv_format : str
        ``"fp8_ds_mla"``, ``"bf16"`` or ``"fp8_ds_mla_v4"``.
    attn_sink : torch.Tensor, optional
        ``[h_q]`` ``float32`` attention sink (see :func:`flash_mla_sparse_fwd`).
    topk_length : torch.Tensor, optional
        ``[B]`` ``int32``: only the first ``topk_length[b]`` indices of request ``b`` count.
    kv_scale_format : str, optional
        How the fp8_ds_mla cache was written (see :func:`write_fp8_ds_mla_cache`): ``"pow2"`` promises
        that every scale is a power of two below ``2^8`` (DeepSeek's writers; a group absmax below 57,344),
        which lets kernels dequantise with a bf16 multiply, giving the same keys faster; ``"arbitrary"`` or
        ``None``: any fp32 scales. A ``"pow2"`` promise broken by the cache gives keys with rounded scales
        (infinite keys from a scale of ``2^8`` on). Only for ``kv_format="fp8_ds_mla"``.
    extra_kv_cache : torch.Tensor, optional
        A second cache in ``kv_format`` (only ``"fp8_ds_mla_v4"``) with its own ``num_blocks`` and
        ``page_size``: DeepSeek-V4's compressed tokens. Given together with ``extra_indices``.
    extra_indices : torch.Tensor, optional
        ``[B, s_q, extra_topk]`` ``int32`` global slots of ``extra_kv_cache``; ``-1`` and out-of-range
        slots are skipped.
    extra_topk_length : torch.Tensor, optional
        ``[B]`` ``int32``: only the first ``extra_topk_length[b]`` extra indices of request ``b`` count.

    Returns
    -------
    out : torch.Tensor
        ``[B, s_q, h_q, d_v]`` ``bfloat16``.
    lse : torch.Tensor
        ``[B, h_q, s_q]`` ``float32`` natural-log sum-exp (``+inf`` for rows without a valid slot).
    """
    values = (q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length, kv_scale_format,
              extra_kv_cache, extra_indices, extra_topk_length, impl)
    key = _decode_replays.key(values)
    if (replay := _decode_replays.get(key)) is not None:
        return replay(values)
    dims: dict[str, int] = {}
    check_tensor(q, "q", dtype=torch.bfloat16, shape=("B", "s_q", "h_q", "d_qk"), dims=dims)
    dev = q.device
    check_choice(kv_format, "kv_format", KV_FORMATS)
    if kv_scale_format is not None:
        check_choice(kv_scale_format, "kv_scale_format", SCALE_FORMATS)
        if kv_format != "fp8_ds_mla":
            raise ValueError(f"kv_scale_format: only for kv_format 'fp8_ds_mla' (None otherwise), got "
                             f"{kv_scale_format!r} with kv_format {kv_format!r}")
    check_int(dims["s_q"], "q.shape[1] (s_q)", min_value=1, max_value=MAX_DECODE_S_Q)
    kv_cache = _check_paged_cache(kv_cache, kv_format, dims["d_qk"], dev)
    check_tensor(indices, "indices", dtype=torch.int32, shape=("B", "s_q", "topk"), dims=dims, device=dev)
    check_float(sm_scale, "sm_scale", positive=True)
    _check_common(dims["h_q"], dims["d_qk"], d_v, dims["topk"])
    attn_sink, topk_length = _check_sink_and_length(attn_sink, topk_length, "B", dims, dev)
    extra_kv_cache, extra_indices, extra_topk_length = _check_extra(
        extra_kv_cache, extra_indices, extra_topk_length, kv_format, dims, dev)
    name = resolve_impl("sparse_mla_decode", impl, {
        "device": dev, "num_heads": dims["h_q"], "d_qk": dims["d_qk"], "topk": dims["topk"], "s_q": dims["s_q"],
        "kv_format": kv_format, "page_size": kv_cache.shape[1],
        "kv_cache_aligned": _pages_aligned(kv_cache) and (extra_kv_cache is None or _pages_aligned(extra_kv_cache))})
    return _decode_replays.run(key, values, name, lambda: _sparse_decode_op(
        q.contiguous(), kv_cache, indices.contiguous(), float(sm_scale), d_v, kv_format, attn_sink, topk_length,
        kv_scale_format, extra_kv_cache, extra_indices, extra_topk_length, name))


def _pages_aligned(cache: torch.Tensor) -> bool:
    """Whether ``cache`` starts at a 16-byte aligned address and its pages are a multiple of 16 bytes apart.
    While ``torch.compile`` traces there is no address: the strides decide (allocations are aligned)."""
    if (cache.stride(0) * cache.element_size()) % 16:
        return False
    return torch.compiler.is_compiling() or cache.data_ptr() % 16 == 0


def _check_extra(extra_kv_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                 extra_topk_length: torch.Tensor | None, kv_format: str, dims: dict[str, int], device: torch.device
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Checked ``(extra_kv_cache 4-D view, extra_indices, extra_topk_length)`` of a V4 decode call."""
    given = {name: x is not None for name, x in (("extra_kv_cache", extra_kv_cache), ("extra_indices", extra_indices),
                                                 ("extra_topk_length", extra_topk_length))}
    if not any(given.values()):
        return None, None, None
    if kv_format not in EXTRA_KV_FORMATS:
        first = next(name for name, present in given.items() if present)
        raise ValueError(f"{first}: a second key list is only for kv_format in {list(EXTRA_KV_FORMATS)} "
                         f"(None otherwise), got kv_format {kv_format!r}")
    if extra_kv_cache is None or extra_indices is None:
        missing = "extra_kv_cache" if extra_kv_cache is None else "extra_indices"
        other = "extra_indices" if extra_kv_cache is None else "extra_kv_cache"
        raise ValueError(f"{missing}: expected a tensor when {other} is given (the extra keys are "
                         f"extra_indices of extra_kv_cache), got None")
    extra_kv_cache = _check_paged_cache(extra_kv_cache, kv_format, dims["d_qk"], device, name="extra_kv_cache")
    check_tensor(extra_indices, "extra_indices", dtype=torch.int32, shape=("B", "s_q", "extra_topk"), dims=dims,
                 device=device)
    check_int(dims["extra_topk"], "extra_indices.shape[-1] (extra_topk)", min_value=1)
    if extra_topk_length is not None:
        check_tensor(extra_topk_length, "extra_topk_length", dtype=torch.int32, shape=("B",), dims=dims,
                     device=device)
        extra_topk_length = extra_topk_length.contiguous()
    return extra_kv_cache, extra_indices.contiguous(), extra_topk_length
