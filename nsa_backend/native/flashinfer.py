"""FlashInfer's SM120 / SM121 sparse MLA decode behind nsa-backend's ``sparse_mla_decode`` signature.

``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=topk)`` on SM120 /
SM121 reads the 656-byte ``fp8_ds_mla`` cache directly (page 64) with per-token top-k slot indices
in place of the block table and the active top-k lengths in place of ``seq_lens``.

Translation only:

- ``kv_scale_format``: ``"arbitrary_fp32"`` reads any fp32 scale (GLM writers, and also
  power-of-two scales); ``"pow2_fp32"`` is DeepSeek's power-of-two form. Default ``"arbitrary"``
  is always correct; :func:`set_kv_scale_format` selects ``"pow2"`` for caches written with
  ``scale_format="pow2"``.
- ``lse``: requested in natural-log units (``return_lse_base="basee"``); releases without that
  argument return base 2, converted here. FlashInfer's ``[B * s_q, H]`` becomes ``[B, H, s_q]``.
- Heads outside FlashInfer's buckets {8, 16, 32, 64, 128} are padded with zero queries.
- Slots outside the cache become ``-1``; rows with no valid index get ``lse = +inf`` and zero
  output, as in the reference.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from types import ModuleType

import torch

from nsa_backend._settings import padded_heads

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
WORKSPACE_BYTES = 128 * 1024 * 1024
_SCALE_FORMATS = {"arbitrary": "arbitrary_fp32", "pow2": "pow2_fp32"}
_scale_format = "arbitrary"


def set_kv_scale_format(scale_format: str) -> None:
    """Scale format of the fp8_ds_mla caches this process decodes: ``"arbitrary"`` or ``"pow2"``."""
    global _scale_format
    if scale_format not in _SCALE_FORMATS:
        raise ValueError(f"scale_format: expected one of {list(_SCALE_FORMATS)}, got {scale_format!r}")
    _scale_format = scale_format


def kv_scale_format_name() -> str:
    """FlashInfer's name of the active scale format (``"arbitrary_fp32"`` or ``"pow2_fp32"``)."""
    return _SCALE_FORMATS[_scale_format]


@functools.cache
def _decode_fn():
    module: ModuleType = importlib.import_module("flashinfer.mla")
    return module.trtllm_batch_decode_with_kv_cache_mla


@functools.cache
def _accepts(param: str) -> bool:
    try:
        return param in inspect.signature(_decode_fn()).parameters
    except (TypeError, ValueError):
        return False


_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    buf = _workspaces.get(device)
    if buf is None:
        buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[device] = buf
    return buf


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
    """Sparse MLA decode through FlashInfer (``kv_format="fp8_ds_mla"``, d_qk 576, d_v 512).

    ``kv_scale_format`` (``"arbitrary"`` / ``"pow2"``) is FlashInfer's ``kv_scale_format``; ``None`` takes
    the process setting (:func:`set_kv_scale_format`).
    """
    # The second key list belongs to the DeepSeek-V4 cache, which routing never sends here.
    if extra_kv_cache is not None or extra_indices is not None or extra_topk_length is not None:
        raise ValueError("extra_kv_cache / extra_indices: FlashInfer sparse decode here serves one key list over the "
                         "fp8_ds_mla cache; use impl='triton' or 'reference' for the DeepSeek-V4 format")
    if kv_format != "fp8_ds_mla":
        raise ValueError(f"kv_format: FlashInfer sparse MLA decode reads the fp8_ds_mla cache only, "
                         f"got {kv_format!r}")
    batch, s_q, heads, _ = q.shape
    topk = indices.shape[2]
    cache = kv_cache if kv_cache.dim() == 3 else kv_cache.squeeze(2)
    num_slots = cache.shape[0] * cache.shape[1]
    invalid = (indices < 0) | (indices >= num_slots)
    indices = torch.where(invalid, torch.full_like(indices, -1), indices).contiguous()
    target = padded_heads("sparse_mla_decode", "flashinfer", heads, q.device)
    if target != heads:
        q = torch.cat([q, q.new_zeros(batch, s_q, target - heads, q.shape[3])], dim=2)
    sinks = None
    if attn_sink is not None:
        sink = attn_sink if target == heads else torch.cat([attn_sink, attn_sink.new_zeros(target - heads)])
        sinks = [sink.contiguous()]
    seq_lens = None
    if topk_length is not None:
        seq_lens = topk_length.to(torch.int32).view(batch, 1).expand(batch, s_q).contiguous()
    kwargs = {}
    natural = _accepts("return_lse_base")
    if natural:
        kwargs["return_lse_base"] = "basee"
    out, lse = _decode_fn()(
        query=q.contiguous(),
        kv_cache=cache,
        workspace_buffer=_workspace(q.device),
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        block_tables=indices,
        seq_lens=seq_lens,
        max_seq_len=topk,
        sparse_mla_top_k=topk,
        bmm1_scale=float(sm_scale),
        bmm2_scale=1.0,
        sinks=sinks,
        return_lse=True,
        kv_scale_format=_SCALE_FORMATS[kv_scale_format] if kv_scale_format else kv_scale_format_name(),
        **kwargs,
    )
    out = out.view(batch, s_q, target, d_v)[:, :, :heads]
    lse = lse.reshape(batch, s_q, target)[:, :, :heads].permute(0, 2, 1)
    if not natural:
        lse = lse * math.log(2.0)
    valid = ~invalid
    if topk_length is not None:
        valid = valid & (torch.arange(topk, device=q.device).view(1, 1, -1) < topk_length.view(-1, 1, 1))
    empty = ~valid.any(dim=2)  # [B, s_q]; no host sync, so the call stays graph-capturable
    lse = lse.masked_fill(empty.view(batch, 1, s_q), float("inf"))
    out = out.masked_fill(empty.view(batch, s_q, 1, 1), 0.0)
    return out, lse
