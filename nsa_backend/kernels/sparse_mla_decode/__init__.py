"""Sparse MLA decode kernels over a paged KV cache ("fp8_ds_mla" or "bf16"): the launcher, split-K with an lse merge.

Every query row ``(b, s)`` of ``q [B, s_q, h_q, 576]`` has its own ``topk`` global slots. The
attention tile kernel (``_sparse_mla_fwd_kernel``, see ``nsa_backend.kernels.sparse_mla_prefill.portable``)
runs on the grid ``(B * s_q, ceil(h_q / BLOCK_H), num_splits)``: the top-k list of a row is cut into
``num_splits`` contiguous chunks, each program attends to one chunk for ``BLOCK_H`` heads and writes
a normalised fp32 partial output and its base-2 lse. ``_sparse_mla_decode_merge_kernel`` (:mod:`.merge`)
then combines the splits of a row:

    m = max_s lse_s,  w_s = 2^(lse_s - m),  out = sum_s w_s out_s / sum_s w_s,  lse = m + log2(sum_s w_s)

converts lse to natural log (``+inf`` for a row without a valid slot), applies ``attn_sink`` and
writes ``out [B, s_q, h_q, 512]`` bf16 and ``lse [B, h_q, s_q]``. With one split the tile kernel
writes the final outputs itself.

FP8 tokens are dequantised in registers (no dequantised copy of the cache). The number of splits
and the workspace size are functions of the shapes and the GPU's multiprocessor count only, and
nothing reads device values on the host, so the call can be captured in a CUDA graph.

On sm_90 the "fp8_ds_mla" cache may instead take a Gluon kernel (asynchronous copies of the gathered
rows, warpgroup MMAs; same merge kernel) unless a launch override is given or ``NSA_BACKEND_GLUON=0``:
:mod:`.sm90_gluon` for the few-head counts where it is faster (``GLUON_DECODE_HEADS``), :mod:`.sm90_gluon_ws`
(warp-specialised, 64 heads per program) from ``GLUON_WS_DECODE_MIN_HEADS`` heads on where that module is
``ENABLED``.

On sm_80 / 86 / 89 / 120 / 121 the "fp8_ds_mla" cache takes the mma.sync Gluon kernel of :mod:`.sm89_gluon` (32-head
programs, ``q`` in registers, the keys converted once per tile, with integer operations on sm_80 / 86) for the head
counts of ``MMA_V2_DECODE_HEADS`` unless a launch override is given or ``NSA_BACKEND_GLUON=0``; under the sm120 proxy
an sm_90 GPU runs it. The bf16
cache takes the mma.sync Gluon kernel of :mod:`.sm80_gluon` on sm_80 / 86 / 89 / 120 / 121 (the bf16 prefill's tile
over the cache's pages, ``MMA_V2_BF16_DECODE_HEADS``) under the same conditions.

The DeepSeek-V4 cache (584-byte tokens, a second cache and index list) has its own ``tl`` kernel,
:mod:`.v4` (its entry point is re-exported here).
"""

from __future__ import annotations

import torch

from nsa_backend.configs.sparse_mla import (
    AttnConfig,
    decode_config,
    decode_num_splits,
    heads_per_program,
    pow2_dequant,
    split_keys,
)
from nsa_backend.kernels._arch import device_arch, device_sms
from nsa_backend.kernels._gluon import gluon_enabled
from nsa_backend.kernels._launch import CachedLauncher, cdiv
from nsa_backend.kernels.sparse_mla_decode import sm80_gluon as mma_v2_bf16
from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as mma_v2
from nsa_backend.kernels.sparse_mla_decode import sm90_gluon_ws as ws
from nsa_backend.kernels.sparse_mla_decode.merge import decode_outputs, launch_split_decode, merge_pdl, merge_splits
from nsa_backend.kernels.sparse_mla_decode.sm90_gluon import (
    GLUON_DECODE_ARCHS,
    gluon_decode_supported,
    sparse_mla_decode_gluon,
)
from nsa_backend.kernels.sparse_mla_decode.sm90_gluon_ws import sparse_mla_decode_gluon_ws
from nsa_backend.kernels.sparse_mla_decode.v4 import sparse_mla_v4_decode_triton
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E, fp8_native
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_fwd_kernel
from nsa_backend.reference import DS_MLA_TOKEN_BYTES

# Launches reusing the compiled kernel per call signature (host time of eager decode steps).
_launch_sparse_mla_fwd = CachedLauncher(_sparse_mla_fwd_kernel)

__all__ = ["DECODE_KERNELS", "decode_kernel", "decode_plan", "merge_pdl", "merge_splits", "sparse_mla_decode_triton",
           "sparse_mla_v4_decode_triton"]

# Multiprocessor count used to plan splits off CUDA (the interpreter).
FALLBACK_NUM_SMS = 8
# Head counts whose fp8 decode takes the few-head Gluon kernels on sm_90 (H200, topk 2048, h_q 16: 96 vs
# 177 us for the tl kernel at B 128, 41 vs 58 us at B 32). More heads take the 64-head kernel below.
GLUON_DECODE_HEADS: frozenset[int] = frozenset(range(1, 17))
# From this many heads on, the fp8 decode takes the warp-specialised 64-head Gluon kernel of
# ``sparse_mla_decode_gluon_ws`` on sm_90 where that module is ``ENABLED`` (heads padded to 64 per
# program). H200, topk 2048: 0.72-0.84x FlashMLA at h_q 128 and 0.89-1.01x at h_q 64, against
# 0.42-0.67x for the tl kernel; at h_q 32 (B 128) 121 against 267 us for the tl kernel.
GLUON_WS_DECODE_MIN_HEADS = 17
# Head counts whose fp8 decode takes the mma.sync Gluon kernel of ``sm89_gluon`` on sm_80 / 86 / 89 / 120 / 121 (32-head
# programs). H100 under the sm_120 proxy, topk 2048, B 32 / 128, s_q 1 / 2, CUDA graphs, against the tl tile in the
# same run: 1.23-1.28x at h_q 16, 1.20-1.31x at 32, 1.11-1.22x at 64 / 128; 1.00-1.07x at 32-128 on another H100,
# whose tl times were 13 % shorter (bench/results/h100-proxy-sm120/decode-mma-v2).
MMA_V2_DECODE_HEADS: frozenset[int] = frozenset(range(1, 129))
# Head counts whose bf16-cache decode takes the mma.sync Gluon kernel of ``sm80_gluon`` on sm_80 / 86 / 89 / 120 / 121
# (32-head programs).
MMA_V2_BF16_DECODE_HEADS: frozenset[int] = frozenset(range(1, 129))


def decode_plan(B: int, s_q: int, h_q: int, topk: int, kv_format: str, device: torch.device,
                config: AttnConfig | None = None,
                num_splits: int | None = None) -> tuple[AttnConfig, int, int]:
    """``(config, num_splits, keys_per_split)`` for a decode call (shapes and device only)."""
    arch = device_arch(device)
    cfg = config or decode_config(heads_per_program(h_q, arch), arch, kv_format == "fp8_ds_mla")
    head_blocks = cdiv(h_q, cfg.block_h)
    if num_splits is None:
        sms = device_sms(device, FALLBACK_NUM_SMS)
        splits, per = decode_num_splits(B * s_q, head_blocks, topk, cfg.block_n, sms, cfg.block_h)
    else:
        splits, per = split_keys(topk, num_splits, cfg.block_n)
    return cfg, splits, per


# The kernels ``sparse_mla_decode_triton`` launches (:func:`decode_kernel`), in words.
DECODE_KERNELS: dict[str, str] = {
    "sm90_gluon": "Gluon few-head decode, fp8_ds_mla cache (sparse_mla_decode/sm90_gluon.py)",
    "sm90_gluon_ws": "warp-specialised Gluon decode, fp8_ds_mla cache (sparse_mla_decode/sm90_gluon_ws.py)",
    "sm89_gluon": "Gluon mma.sync decode, fp8_ds_mla cache (sparse_mla_decode/sm89_gluon.py)",
    "sm80_gluon": "Gluon mma.sync decode, bf16 cache (sparse_mla_decode/sm80_gluon.py)",
    "portable": "portable tl decode tile (sparse_mla_prefill/portable.py)",
}


def _gluon_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether the Gluon kernel takes this call (sm_90, fp8 cache, a head count it is faster for)."""
    if kv_format != "fp8_ds_mla" or q.shape[2] not in GLUON_DECODE_HEADS:
        return False
    return gluon_enabled(arch, GLUON_DECODE_ARCHS) and gluon_decode_supported(q, kv_cache, kv_format, d_v, arch)


def _gluon_ws_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether the warp-specialised 64-head Gluon kernel takes this call (sm_90, fp8 cache, from
    ``GLUON_WS_DECODE_MIN_HEADS`` heads on, the kernel ``ENABLED``)."""
    if kv_format != "fp8_ds_mla" or q.shape[2] < GLUON_WS_DECODE_MIN_HEADS:
        return False
    if not ws.ENABLED:
        return False
    return gluon_enabled(arch, ws.GLUON_WS_DECODE_ARCHS) and ws.supported(q, kv_cache, kv_format, d_v, arch)


def _mma_v2_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether the mma.sync Gluon kernel takes this call (sm_80 / 86 / 89 / 120 / 121, fp8 cache, a head count of
    ``MMA_V2_DECODE_HEADS``)."""
    if kv_format != "fp8_ds_mla" or q.shape[2] not in MMA_V2_DECODE_HEADS:
        return False
    return gluon_enabled(arch, mma_v2.MMA_V2_DECODE_ARCHS) and mma_v2.supported(q, kv_cache, kv_format, d_v, arch)


def _mma_v2_bf16_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> bool:
    """Whether the mma.sync Gluon kernel takes this bf16-cache call (sm_80 / 86 / 89 / 120 / 121, a head count of
    ``MMA_V2_BF16_DECODE_HEADS``)."""
    if kv_format != "bf16" or q.shape[2] not in MMA_V2_BF16_DECODE_HEADS:
        return False
    return (gluon_enabled(arch, mma_v2_bf16.MMA_V2_BF16_DECODE_ARCHS)
            and mma_v2_bf16.supported(q, kv_cache, kv_format, d_v, arch))


def decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int, arch: int | None) -> str:
    """The kernel :func:`sparse_mla_decode_triton` launches for this call on ``sm_<arch>`` (``None``: off CUDA)
    without a launch override: a key of ``DECODE_KERNELS``. Only the tensors' shapes, strides, dtypes and
    alignment count, so a planner can ask with stand-ins of the call's tensors."""
    if _gluon_route(q, kv_cache, kv_format, d_v, arch):
        return "sm90_gluon"
    if _gluon_ws_route(q, kv_cache, kv_format, d_v, arch):
        return "sm90_gluon_ws"
    if _mma_v2_route(q, kv_cache, kv_format, d_v, arch):
        return "sm89_gluon"
    if _mma_v2_bf16_route(q, kv_cache, kv_format, d_v, arch):
        return "sm80_gluon"
    return "portable"


def sparse_mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    kv_scale_format: str | None = None,
    *,
    config: AttnConfig | None = None,
    num_splits: int | None = None,
    native_fp8: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`nsa_backend.sparse_mla_decode` (see the module docstring).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, s_q, h_q, d_qk]`` ``bfloat16``, contiguous.
    kv_cache : torch.Tensor
        ``kv_format="fp8_ds_mla"``: ``uint8 [num_blocks, page, 656]`` or ``[num_blocks, page, 1, 656]``
        (``d_qk = 576``); ``"bf16"``: ``bfloat16 [num_blocks, page, 1, d_qk]``. ``stride(0)`` may be padded.
    indices : torch.Tensor
        ``[B, s_q, topk]`` ``int32`` global slots; negative slots and slots ``>= num_blocks * page``
        are skipped.
    sm_scale : float
        Softmax scale applied to ``q . k``.
    d_v : int
        Value head dim (512).
    kv_format : str
        ``"fp8_ds_mla"`` or ``"bf16"``.
    attn_sink : torch.Tensor, optional
        ``[h_q]`` ``float32``: ``out *= exp(lse) / (exp(lse) + exp(sink))``.
    topk_length : torch.Tensor, optional
        ``[B]`` ``int32``: request ``b`` uses its first ``topk_length[b]`` indices.
    kv_scale_format : str, optional
        ``"pow2"``: every scale of the fp8 cache is a power of two below ``2^8``, which the sm_90 Gluon kernels
        and, on archs without an fp8 unit, the ``tl`` tile dequantise with fewer instructions (same numbers;
        ``nsa_backend.configs.sparse_mla.pow2_dequant``); ``None`` / ``"arbitrary"``: any scales.
    config, num_splits, native_fp8 : optional
        Override the launch configuration, the split of the top-k list over programs and the e4m3
        decoding path chosen from the shapes and the architecture.

    Returns
    -------
    tuple of torch.Tensor
        ``out [B, s_q, h_q, d_v] bfloat16`` and ``lse [B, h_q, s_q] float32`` (natural log).
    """
    B, s_q, h_q, d_qk = q.shape
    planned = config is None and num_splits is None and native_fp8 is None
    arch = device_arch(q.device)
    kernel = decode_kernel(q, kv_cache, kv_format, d_v, arch) if planned else "portable"
    if kernel == "sm90_gluon":
        return sparse_mla_decode_gluon(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length,
                                       kv_scale_format=kv_scale_format)
    if kernel == "sm90_gluon_ws":
        return sparse_mla_decode_gluon_ws(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink,
                                          topk_length, kv_scale_format=kv_scale_format)
    if kernel == "sm89_gluon":
        return mma_v2.sparse_mla_decode_mma_v2(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink,
                                               topk_length, kv_scale_format=kv_scale_format)
    if kernel == "sm80_gluon":
        return mma_v2_bf16.sparse_mla_decode_bf16_mma_v2(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink,
                                                         topk_length)
    topk = indices.shape[-1]
    dev = q.device
    out, lse = decode_outputs(q, d_v)
    if B == 0:
        return out, lse
    fp8 = kv_format == "fp8_ds_mla"
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    width = DS_MLA_TOKEN_BYTES if fp8 else d_qk
    cfg, splits, per = decode_plan(B, s_q, h_q, topk, kv_format, dev, config, num_splits)
    idx = indices.view(B * s_q, topk)
    native = fp8_native(arch) if native_fp8 is None else native_fp8
    common = dict(
        D_ROPE=d_qk - d_v, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, KV_FP8=fp8, FP8_NATIVE=native,
        IDX_AHEAD=cfg.idx_ahead, SHARE_KEYS=cfg.share_keys and fp8, REREAD_KEYS=cfg.reread_keys and fp8,
        POW2_SCALES=fp8 and pow2_dequant(kv_scale_format, native), **cfg.launch_options(),
    )
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), width)
    # (the tile's sink flag follows its sink pointer, which split launches leave out)
    launch_split_decode(_launch_sparse_mla_fwd, cdiv(h_q, cfg.block_h), splits, (q, kv_cache, idx), attn_sink,
                        topk_length, out, lse, args, lambda split: dict(SPLIT=split, **common), after_lse=(None,),
                        grid="rows_heads")
    return out, lse
