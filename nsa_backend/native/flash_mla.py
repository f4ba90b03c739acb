"""FlashMLA behind nsa-backend's signatures: sparse MLA prefill and FP8 sparse decode.

Argument translation only:

- Heads: FlashMLA takes h_q in {64, 128}; fewer heads are padded with zero queries and the extra
  outputs dropped.
- ``use_legacy``: the ``sgl-flash-mla`` build keeps SM90 and the DeepSeek-V3.2 formats (d_qk 576,
  the 656-byte ``fp8_ds_mla`` cache) in its legacy kernels, reached with ``use_legacy=True``; its
  current kernels serve d_qk 512 on SM100. Upstream FlashMLA has no such argument and serves both.
- Top-k width: the kernels work in blocks of 64 (decode) / 128 (prefill) indices; other widths are
  padded with ``-1``.
- Decode indices: FlashMLA treats only ``-1`` as invalid and does not bound-check, so slots outside
  the cache become ``-1`` here. The cache may be ``[num_blocks, page, 656]`` or
  ``[num_blocks, page, 1, 656]``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Any

import torch

from nsa_backend.routing.router import get_padded_heads

PREFILL_TOPK_BLOCK = 128
DECODE_TOPK_BLOCK = 64


@functools.cache
def _module() -> ModuleType:
    return importlib.import_module("flash_mla")


@functools.cache
def _has_use_legacy(func_name: str) -> bool:
    try:
        return "use_legacy" in inspect.signature(getattr(_module(), func_name)).parameters
    except (TypeError, ValueError):
        return False


def _device_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def legacy_kwargs(func_name: str, d_qk: int, device: torch.device, fp8_cache: bool = False) -> dict[str, Any]:
    """``{"use_legacy": True}`` when the installed FlashMLA needs it for this call, else ``{}``."""
    if not _has_use_legacy(func_name):
        return {}
    use_legacy = fp8_cache or d_qk != 512 or _device_major(device) == 9
    return {"use_legacy": True} if use_legacy else {}


def _pad_dim(x: torch.Tensor, dim: int, target: int, value: float = 0.0) -> torch.Tensor:
    extra = target - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim).contiguous()


def _round_up(x: int, block: int) -> int:
    return (x + block - 1) // block * block


def _apply_topk_length(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """Mark entries past each row's ``topk_length`` invalid (-1).

    ``indices`` is ``[R, *, topk]`` and ``topk_length`` ``[R]`` (prefill rows, or decode requests).
    FlashMLA's V3.2 kernels (the SM90 ones reached with ``use_legacy=True``) refuse a dynamic top-k
    length; every FlashMLA kernel skips -1 entries, so this is the same computation, without a host sync.
    """
    if topk_length is None:
        return indices
    rank = torch.arange(indices.shape[-1], device=indices.device)
    keep = rank < topk_length.view(-1, 1, 1)
    return torch.where(keep, indices, torch.full_like(indices, -1))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_mla.flash_mla_sparse_fwd`` (natural-log ``lse``)."""
    fm = _module()
    heads, d_qk = q.shape[1], q.shape[2]
    target = get_padded_heads("flash_mla_sparse_fwd", "flash_mla", heads, device=q.device)
    q = _pad_dim(q, 1, target)
    if attn_sink is not None:
        attn_sink = _pad_dim(attn_sink, 0, target)
    indices = _apply_topk_length(indices, topk_length)
    indices = _pad_dim(indices, 2, _round_up(indices.shape[2], PREFILL_TOPK_BLOCK), -1)
    kwargs = legacy_kwargs("flash_mla_sparse_fwd", d_qk, q.device)
    out, max_logits, lse = fm.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, None, **kwargs)
    if target != heads:
        out, max_logits, lse = out[:, :heads], max_logits[:, :heads], lse[:, :heads]
    return out, max_logits, lse


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla.flash_mla_with_kvcache`` in sparse FP8 mode (``kv_format="fp8_ds_mla"`` only)."""
    if kv_format != "fp8_ds_mla":
        raise ValueError(f"kv_format: FlashMLA sparse decode reads the fp8_ds_mla cache only, got {kv_format!r}")
    fm = _module()
    heads, d_qk = q.shape[2], q.shape[3]
    cache = kv_cache if kv_cache.dim() == 4 else kv_cache.unsqueeze(2)
    num_slots = cache.shape[0] * cache.shape[1]
    indices = torch.where((indices < 0) | (indices >= num_slots), torch.full_like(indices, -1), indices)
    indices = _apply_topk_length(indices, topk_length)
    indices = _pad_dim(indices, 2, _round_up(indices.shape[2], DECODE_TOPK_BLOCK), -1)
    target = get_padded_heads("sparse_mla_decode", "flash_mla", heads, device=q.device)
    q = _pad_dim(q, 2, target)
    if attn_sink is not None:
        attn_sink = _pad_dim(attn_sink, 0, target)
    sched, _ = fm.get_mla_metadata()
    kwargs = legacy_kwargs("flash_mla_with_kvcache", d_qk, q.device, fp8_cache=True)
    out, lse = fm.flash_mla_with_kvcache(
        q, cache, None, None, d_v, sched, None,
        softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True, indices=indices.contiguous(),
        attn_sink=attn_sink, topk_length=None, **kwargs,
    )
    if target != heads:
        out, lse = out[:, :, :heads], lse[:, :heads]
    return out, lse
