"""FlashMLA behind nsa-backend's signatures: sparse MLA prefill and FP8 sparse decode.

Argument translation only:

- Heads: FlashMLA takes h_q in {64, 128}; fewer heads are padded with zero queries and the extra
  outputs dropped.
- ``use_legacy``: the ``sgl-flash-mla`` build keeps SM90 and the DeepSeek-V3.2 formats (d_qk 576,
  the 656-byte ``fp8_ds_mla`` cache) in its legacy kernels, reached with ``use_legacy=True``; its
  current kernels serve d_qk 512 on SM100. Upstream FlashMLA has no such argument and serves both.
- DeepSeek-V4 decode (``kv_format="fp8_ds_mla_v4"``, the 584-byte cache, d_qk 512): the same sparse call
  (in ``sgl-flash-mla``, its legacy kernels with ``kv_format="V4"``; its current ones read DeepSeek-V4.1's
  528-byte rows only) with ``extra_k_cache`` / ``extra_indices_in_kvcache`` for the second key list,
  whose indices get the same treatment as the main ones (``extra_topk_length`` applied here, slots
  outside the extra cache -1).
- Top-k width: the kernels work in blocks of 64 (decode) / 128 (prefill) indices; other widths are
  padded with ``-1``.
- Indices (prefill and decode): FlashMLA treats only ``-1`` as invalid and does not bound-check, so
  rows outside ``kv`` / slots outside the cache, entries past ``topk_length`` and the padding columns
  become ``-1`` here, in one launch (:func:`nsa_backend.kernels.slots.mask_invalid_slots`). The cache may be
  ``[num_blocks, page, 656]`` or ``[num_blocks, page, 1, 656]``.
- Decode schedule: FlashMLA computes its split-KV schedule on the first call with a fresh
  ``get_mla_metadata()`` object and reuses it while the shapes stay the same (the top-k lengths are
  applied to the indices here, so the schedule depends on the shapes only). One object per shape is
  kept, as frameworks share one across the layers of a step; a fresh object per call recomputed
  the schedule every call (H200, B 32, h_q 64, CUDA graph: 77.6 against 47.6 us per call). An object
  first used while a CUDA graph is being captured is not kept (its schedule is only computed when
  the graph replays), and an object used in a capture is never dropped (the graph reads it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections import OrderedDict
from types import ModuleType
from typing import Any

import torch

from nsa_backend._settings import padded_heads
from nsa_backend.kernels.slots import mask_invalid_slots

PREFILL_TOPK_BLOCK = 128
DECODE_TOPK_BLOCK = 64
# Decode schedules kept (one per shape, least recently used dropped first, except those used in a
# CUDA graph capture).
SCHEDULE_CACHE_SIZE = 64

_schedules: OrderedDict[tuple, Any] = OrderedDict()
_captured: dict[tuple, Any] = {}
_schedules_lock = threading.Lock()


@functools.cache
def _module() -> ModuleType:
    return importlib.import_module("flash_mla")


@functools.cache
def _accepts(func_name: str, parameter: str) -> bool:
    """Whether the installed FlashMLA's ``func_name`` takes ``parameter`` (sgl-flash-mla's ``use_legacy``,
    ``kv_format``; upstream FlashMLA has neither)."""
    try:
        return parameter in inspect.signature(getattr(_module(), func_name)).parameters
    except (TypeError, ValueError):
        return False


def _device_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def legacy_kwargs(func_name: str, d_qk: int, device: torch.device, fp8_cache: bool = False) -> dict[str, Any]:
    """``{"use_legacy": True}`` when the installed FlashMLA needs it for this call, else ``{}``."""
    if not _accepts(func_name, "use_legacy"):
        return {}
    use_legacy = fp8_cache or d_qk != 512 or _device_major(device) == 9
    return {"use_legacy": True} if use_legacy else {}


def _pad_dim(x: torch.Tensor, dim: int, target: int, value: float = 0.0) -> torch.Tensor:
    """``x`` padded with ``value`` to ``target`` along ``dim`` (one launch: a graph-captured decode step
    pays per kernel)."""
    extra = target - x.shape[dim]
    if extra <= 0:
        return x
    widths = [0] * (2 * (x.dim() - dim % x.dim()))
    widths[-1] = extra  # torch.nn.functional.pad lists the last dim first: (left, right) per dim
    return torch.nn.functional.pad(x, widths, value=value)


def _round_up(x: int, block: int) -> int:
    return (x + block - 1) // block * block


def _decode_schedule(fm: ModuleType, key: tuple) -> Any:
    """The schedule object of decode calls of shape ``key`` (see the module docstring)."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    with _schedules_lock:
        sched = _captured.get(key)
        if sched is None:
            sched = _schedules.get(key)
        if sched is None:
            sched = fm.get_mla_metadata()[0]
            if capturing:
                return sched
            _schedules[key] = sched
            while len(_schedules) > SCHEDULE_CACHE_SIZE:
                _schedules.popitem(last=False)
        elif key in _schedules:
            _schedules.move_to_end(key)
        if capturing:
            _captured[key] = sched
        return sched


def clear_decode_schedules() -> None:
    """Forget the kept decode schedules (tests, or after freeing every graph that used them)."""
    with _schedules_lock:
        _schedules.clear()
        _captured.clear()


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
    target = padded_heads("flash_mla_sparse_fwd", "flash_mla", heads, q.device)
    q = _pad_dim(q, 1, target)
    if attn_sink is not None:
        attn_sink = _pad_dim(attn_sink, 0, target)
    # FlashMLA's V3.2 kernels (reached with use_legacy=True on SM90) refuse a dynamic top-k length:
    # entries past it become -1, which every FlashMLA kernel skips (same computation, no host sync)
    indices = mask_invalid_slots(indices, kv.shape[0], topk_length, _round_up(indices.shape[2], PREFILL_TOPK_BLOCK))
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
    kv_scale_format: str | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla.flash_mla_with_kvcache`` in sparse FP8 mode over the ``fp8_ds_mla`` cache (d_qk 576) or
    the DeepSeek-V4 ``fp8_ds_mla_v4`` cache (d_qk 512, with the optional extra cache and index list).
    ``kv_scale_format`` is not needed: FlashMLA reads the scales as stored."""
    if kv_format not in ("fp8_ds_mla", "fp8_ds_mla_v4"):
        raise ValueError(f"kv_format: FlashMLA sparse decode reads the fp8_ds_mla or fp8_ds_mla_v4 cache, "
                         f"got {kv_format!r}")
    v4 = kv_format == "fp8_ds_mla_v4"
    if not v4 and (extra_kv_cache is not None or extra_indices is not None or extra_topk_length is not None):
        raise ValueError("extra_kv_cache / extra_indices: a second key list is only for kv_format "
                         f"'fp8_ds_mla_v4', got kv_format {kv_format!r}")
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache / extra_indices: expected both or neither, got "
                         f"extra_kv_cache={'a tensor' if extra_kv_cache is not None else None}, "
                         f"extra_indices={'a tensor' if extra_indices is not None else None}")
    fm = _module()
    heads, d_qk = q.shape[2], q.shape[3]
    cache = kv_cache if kv_cache.dim() == 4 else kv_cache.unsqueeze(2)
    width = _round_up(indices.shape[2], DECODE_TOPK_BLOCK)
    indices = mask_invalid_slots(indices, cache.shape[0] * cache.shape[1], topk_length, width)
    extra_cache, extra_width = None, None
    if extra_kv_cache is not None and extra_indices is not None:
        # Same treatment as the main list: lengths, -1 for slots outside the extra cache, blocks of 64.
        extra_cache = extra_kv_cache if extra_kv_cache.dim() == 4 else extra_kv_cache.unsqueeze(2)
        extra_width = _round_up(extra_indices.shape[2], DECODE_TOPK_BLOCK)
        extra_indices = mask_invalid_slots(extra_indices, extra_cache.shape[0] * extra_cache.shape[1],
                                           extra_topk_length, extra_width)
    target = padded_heads("sparse_mla_decode", "flash_mla", heads, q.device)
    q = _pad_dim(q, 2, target)
    if attn_sink is not None:
        attn_sink = _pad_dim(attn_sink, 0, target)
    # Both caches are legacy formats in sgl-flash-mla (its current kernels read V4.1's 528-byte rows only).
    kwargs = legacy_kwargs("flash_mla_with_kvcache", d_qk, q.device, fp8_cache=True)
    if v4 and kwargs and _accepts("flash_mla_with_kvcache", "kv_format"):
        # Named rather than detected from the row size, so a layout mix-up is FlashMLA's error, not a wrong read.
        kwargs["kv_format"] = "V4"
    extra_kwargs: dict[str, Any] = {}
    if extra_cache is not None:
        extra_kwargs = {"extra_k_cache": extra_cache, "extra_indices_in_kvcache": extra_indices,
                        "extra_topk_length": None}
    key = (q.device, *q.shape[:3], *cache.shape[1:3], width, tuple(sorted(kwargs.items())), id(fm),
           extra_cache.shape[1] if extra_cache is not None else None, extra_width)
    out, lse = fm.flash_mla_with_kvcache(
        q, cache, None, None, d_v, _decode_schedule(fm, key), None,
        softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True, indices=indices,
        attn_sink=attn_sink, topk_length=None, **extra_kwargs, **kwargs,
    )
    if target != heads:
        out, lse = out[:, :, :heads], lse[:, :heads]
    return out, lse
