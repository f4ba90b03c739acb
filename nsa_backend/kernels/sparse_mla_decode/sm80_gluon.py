"""Gluon sparse MLA decode over a bf16 paged cache for the mma.sync archs (sm_80 / 86 / 89 / 120 / 121).

The kernel is the bf16 one of ``nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py`` (32 heads and 32 keys per
tile, ``q``'s latent part in registers, a ``cp.async`` ring of bf16 rows that both products read): the decode
gives it the cache's pages (row ``slot % page`` of page ``slot // page``), splits the top-k list until the
programs of all rows fill the GPU once (one program per SM, as the fp8 decode of :mod:`.sm89_gluon` plans) and
merges the splits' partials with :func:`nsa_backend.kernels.sparse_mla_decode.merge.merge_splits`.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import wave_filling_splits
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._launch import cached_launcher
from nsa_backend.kernels.sparse_mla_decode.merge import decode_outputs, launch_split_decode
from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as tile
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E

# Architectures the kernel is written for (mma.sync, bf16 keys).
MMA_V2_BF16_DECODE_ARCHS: tuple[int, ...] = tile.MMA_V2_PREFILL_ARCHS


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether :func:`sparse_mla_decode_bf16_mma_v2` can run this call (the caller checks ``gluon_enabled``): the
    bf16 cache ``[num_blocks, page, 1, 576]`` with 16-byte aligned rows and pages, ``d_v = 512``, an arch of
    ``MMA_V2_BF16_DECODE_ARCHS``."""
    if kv_format != "bf16" or q.shape[-1] != 576 or d_v != 512 or arch not in MMA_V2_BF16_DECODE_ARCHS:
        return False
    if kv_cache.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or kv_cache.stride(-1) != 1:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 8 or kv_cache.stride(1) % 8:
        return False
    if q.stride(-1) != 1 or q.stride(1) % 8 or q.stride(2) % 8 or q.data_ptr() % 16:
        return False
    return q.shape[2] > 0


def plan(B: int, s_q: int, h_q: int, topk: int, num_sms: int,
         num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)``: one program fills an SM's shared memory, so the top-k list is split
    until the programs of all rows and head blocks make one wave of one program per SM, or further where that
    leaves part of the GPU idle for the whole call (``wave_filling_splits``)."""
    return wave_filling_splits(B * s_q, triton.cdiv(h_q, tile.BLOCK_H), topk, tile.BLOCK_N, num_sms, num_splits)


def sparse_mla_decode_bf16_mma_v2(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "bf16",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    stages: int = tile.STAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.sparse_mla_decode` for the bf16 cache on the mma.sync archs.

    Same parameters and results as ``sparse_mla_decode_triton``; the inputs must pass :func:`supported`.
    ``num_splits`` overrides the plan, ``stages`` the ring's depth.
    """
    B, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    out, lse = decode_outputs(q, d_v)
    if B == 0 or s_q == 0:
        return out, lse
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    idx = indices.view(B * s_q, topk)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    splits, per = plan(B, s_q, h_q, topk, device_sms(q.device, 8), num_splits)
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    launch_split_decode(
        cached_launcher(tile.kernel()), triton.cdiv(h_q, tile.BLOCK_H), splits, (q, kv_cache, idx), attn_sink,
        topk_length, out, lse, args,
        lambda split: tile.constexprs(page, split, attn_sink is not None and not split, topk_length is not None,
                                      False, stages),
        after_lse=(None,), grid="flat",
    )
    return out, lse


__all__ = ["MMA_V2_BF16_DECODE_ARCHS", "plan", "sparse_mla_decode_bf16_mma_v2", "supported"]
