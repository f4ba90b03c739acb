"""Triton sparse MLA decode over a paged KV cache ("fp8_ds_mla" or "bf16"), split-K with an lse merge.

Every query row ``(b, s)`` of ``q [B, s_q, h_q, 576]`` has its own ``topk`` global slots. The
attention tile kernel (``_sparse_mla_fwd_kernel``, see ``nsa_backend.kernels.sparse_mla_prefill``)
runs on the grid ``(B * s_q, ceil(h_q / BLOCK_H), num_splits)``: the top-k list of a row is cut into
``num_splits`` contiguous chunks, each program attends to one chunk for ``BLOCK_H`` heads and writes
a normalised fp32 partial output and its base-2 lse. ``_sparse_mla_decode_merge_kernel`` then
combines the splits of a row:

    m = max_s lse_s,  w_s = 2^(lse_s - m),  out = sum_s w_s out_s / sum_s w_s,  lse = m + log2(sum_s w_s)

converts lse to natural log (``+inf`` for a row without a valid slot), applies ``attn_sink`` and
writes ``out [B, s_q, h_q, 512]`` bf16 and ``lse [B, h_q, s_q]``. With one split the tile kernel
writes the final outputs itself.

FP8 tokens are dequantised in registers (no dequantised copy of the cache). The number of splits
and the workspace size are functions of the shapes and the GPU's multiprocessor count only, and
nothing reads device values on the host, so the call can be captured in a CUDA graph.

On sm_90 the "fp8_ds_mla" cache may instead take a Gluon kernel (asynchronous copies of the gathered
rows, warpgroup MMAs; same merge kernel) unless a launch override is given or ``NSA_BACKEND_GLUON=0``:
``nsa_backend.kernels.sparse_mla_decode_gluon`` for the few-head counts where it is faster
(``GLUON_DECODE_HEADS``), ``nsa_backend.kernels.sparse_mla_decode_gluon_ws`` (warp-specialised, 64 heads
per program) from ``GLUON_WS_DECODE_MIN_HEADS`` heads on where that module is ``ENABLED``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_backend import envs
from nsa_backend.configs.sparse_mla import (
    MERGE_BLOCK_H,
    MERGE_NUM_WARPS,
    AttnConfig,
    decode_config,
    decode_num_splits,
    merge_block_d,
    split_keys,
)
from nsa_backend.kernels._arch import device_arch, device_capability, device_sms
from nsa_backend.kernels._gluon import gluon_enabled
from nsa_backend.kernels._launch import CachedLauncher
from nsa_backend.kernels.sparse_mla_prefill import (
    LOG2E,
    _sparse_mla_bf16,
    _sparse_mla_fwd_kernel,
    block_h_for,
    fp8_native,
)
from nsa_backend.reference import DS_MLA_TOKEN_BYTES

try:  # grid dependency control (Triton >= 3.4 on CUDA)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older Triton: plain launches
    gdc_wait = None

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
# Programmatic dependent launch of the split merge from this capability on (grid dependency control).
PDL_MIN_ARCH = 90


@triton.heuristics({"HAS_SINK": lambda args: args["sink_ptr"] is not None})
@triton.jit(do_not_specialize=["h_q", "s_q", "num_splits"])
def _sparse_mla_decode_merge_kernel(
    part_o_ptr,  # [R, NS, h_q, D_V] f32
    part_lse_ptr,  # [R, NS, h_q] f32 (base 2)
    sink_ptr,
    out_ptr,  # [B, s_q, h_q, D_V] bf16
    lse_ptr,  # [B, h_q, s_q] f32
    h_q, s_q, num_splits,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
    WAIT_PRIMARY: tl.constexpr,
):
    # grid (rows, head blocks, D_V / BLOCK_D): every program recombines BLOCK_D columns of BLOCK_H heads
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_d = tl.program_id(2)
    i_b = i_r // s_q
    i_q = i_r % s_q
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    if WAIT_PRIMARY:
        # launched before the split kernel finished (programmatic dependent launch): its partials are
        # complete and visible after this wait
        gdc_wait()

    p_lse = part_lse_ptr + i_r * num_splits * h_q + o_h
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for i_s in range(num_splits):
        b_m = tl.maximum(b_m, tl.load(p_lse + i_s * h_q, mask=m_h, other=float("-inf")))
    m_empty = b_m == float("-inf")
    b_m_use = tl.where(m_empty, 0.0, b_m)
    b_w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    p_o = part_o_ptr + (i_r * num_splits * h_q + o_h.to(tl.int64))[:, None] * D_V + o_d[None, :]
    for i_s in range(num_splits):
        b_w = tl.math.exp2(tl.load(p_lse + i_s * h_q, mask=m_h, other=float("-inf")) - b_m_use)
        b_o = tl.load(p_o + i_s * h_q * D_V, mask=m_h[:, None], other=0.0)
        b_acc += b_w[:, None] * b_o
        b_w_sum += b_w
    b_o = b_acc / tl.where(m_empty, 1.0, b_w_sum)[:, None]
    b_lse2 = b_m_use + tl.math.log2(tl.where(m_empty, 1.0, b_w_sum))
    b_lse = tl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=0.0)
        b_o = b_o * (1.0 / (1.0 + tl.exp(b_sink - tl.where(m_empty, 0.0, b_lse))))[:, None]
    p_out = out_ptr + ((i_r * h_q + o_h.to(tl.int64)) * D_V)[:, None] + o_d[None, :]
    tl.store(p_out, _sparse_mla_bf16(b_o), mask=m_h[:, None])
    if i_d == 0:
        tl.store(lse_ptr + i_b * h_q * s_q + o_h * s_q + i_q, b_lse, mask=m_h)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, attn_sink: torch.Tensor | None,
                 out: torch.Tensor, lse: torch.Tensor) -> None:
    """Combine the ``num_splits`` partial results of every query row into ``out`` and ``lse``.

    ``part_o`` ``[R, num_splits, h_q, d_v]`` fp32 (each split normalised by its own sum),
    ``part_lse`` ``[R, num_splits, h_q]`` fp32 (base 2, ``-inf`` for a split without a valid slot),
    ``out`` ``[B, s_q, h_q, d_v]`` bf16 and ``lse`` ``[B, h_q, s_q]`` fp32 with ``R = B * s_q``; all
    contiguous. The output columns are cut into slices (``configs.sparse_mla.merge_block_d``) so that few
    rows still spread over the GPU. Called right after the kernel that wrote the partials: from sm_90 on
    the merge is a programmatic dependent launch (``merge_pdl``), so its launch overlaps that kernel's
    last programs.
    """
    R, splits, h_q, d_v = part_o.shape
    head_blocks = triton.cdiv(h_q, MERGE_BLOCK_H)
    block_d = merge_block_d(R * head_blocks, d_v, device_sms(part_o.device))
    pdl = merge_pdl(part_o.device)
    _launch_sparse_mla_decode_merge[(R, head_blocks, d_v // block_d)](
        part_o, part_lse, attn_sink, out, lse, h_q, out.shape[1], splits,
        D_V=d_v, BLOCK_H=MERGE_BLOCK_H, BLOCK_D=block_d, WAIT_PRIMARY=pdl, num_warps=MERGE_NUM_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )


def merge_pdl(device: torch.device) -> bool:
    """Whether the split merge on ``device`` is a programmatic dependent launch: an sm_90+ GPU (its own
    capability, whatever arch routing is forced to: the wait is an sm_90 instruction), not the interpreter,
    and a Triton with grid dependency control."""
    if gdc_wait is None or envs.triton_interpret():
        return False
    cap = device_capability(device)
    return cap is not None and cap >= PDL_MIN_ARCH


def decode_plan(B: int, s_q: int, h_q: int, topk: int, kv_format: str, device: torch.device,
                config: AttnConfig | None = None,
                num_splits: int | None = None) -> tuple[AttnConfig, int, int]:
    """``(config, num_splits, keys_per_split)`` for a decode call (shapes and device only)."""
    arch = device_arch(device)
    cfg = config or decode_config(block_h_for(h_q, arch), arch, kv_format == "fp8_ds_mla")
    head_blocks = triton.cdiv(h_q, cfg.block_h)
    if num_splits is None:
        sms = device_sms(device, FALLBACK_NUM_SMS)
        splits, per = decode_num_splits(B * s_q, head_blocks, topk, cfg.block_n, sms, cfg.block_h)
    else:
        splits, per = split_keys(topk, num_splits, cfg.block_n)
    return cfg, splits, per


def _gluon_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int) -> bool:
    """Whether the Gluon kernel takes this call (sm_90, fp8 cache, a head count it is faster for)."""
    if kv_format != "fp8_ds_mla" or q.shape[2] not in GLUON_DECODE_HEADS:
        return False
    arch = device_arch(q.device)
    from nsa_backend.kernels.sparse_mla_decode_gluon import GLUON_DECODE_ARCHS, gluon_decode_supported

    return gluon_enabled(arch, GLUON_DECODE_ARCHS) and gluon_decode_supported(q, kv_cache, kv_format, d_v, arch)


def _gluon_ws_route(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int) -> bool:
    """Whether the warp-specialised 64-head Gluon kernel takes this call (sm_90, fp8 cache, from
    ``GLUON_WS_DECODE_MIN_HEADS`` heads on, the kernel ``ENABLED``)."""
    if kv_format != "fp8_ds_mla" or q.shape[2] < GLUON_WS_DECODE_MIN_HEADS:
        return False
    from nsa_backend.kernels import sparse_mla_decode_gluon_ws as ws

    if not ws.ENABLED:
        return False
    arch = device_arch(q.device)
    return gluon_enabled(arch, ws.GLUON_WS_DECODE_ARCHS) and ws.supported(q, kv_cache, kv_format, d_v, arch)


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
        ``"pow2"``: every scale of the fp8 cache is a power of two, which the sm_90 Gluon kernels
        dequantise with fewer instructions (same numbers); ``None`` / ``"arbitrary"``: any scales.
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
    if planned and _gluon_route(q, kv_cache, kv_format, d_v):
        from nsa_backend.kernels.sparse_mla_decode_gluon import sparse_mla_decode_gluon

        return sparse_mla_decode_gluon(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length,
                                       kv_scale_format=kv_scale_format)
    if planned and _gluon_ws_route(q, kv_cache, kv_format, d_v):
        from nsa_backend.kernels.sparse_mla_decode_gluon_ws import sparse_mla_decode_gluon_ws

        return sparse_mla_decode_gluon_ws(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink,
                                          topk_length, kv_scale_format=kv_scale_format)
    topk = indices.shape[-1]
    dev = q.device
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=dev)
    if B == 0:
        return out, lse
    fp8 = kv_format == "fp8_ds_mla"
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    width = DS_MLA_TOKEN_BYTES if fp8 else d_qk
    cfg, splits, per = decode_plan(B, s_q, h_q, topk, kv_format, dev, config, num_splits)
    arch = device_arch(dev)
    R = B * s_q
    idx = indices.view(R, topk)
    head_blocks = triton.cdiv(h_q, cfg.block_h)
    common = dict(
        D_ROPE=d_qk - d_v, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        KV_FP8=fp8, FP8_NATIVE=fp8_native(arch) if native_fp8 is None else native_fp8,
        IDX_AHEAD=cfg.idx_ahead,
        **cfg.launch_options(),
    )
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), width)
    if splits == 1:
        _launch_sparse_mla_fwd[(R, head_blocks, 1)](
            q, kv_cache, idx, attn_sink, topk_length, out, lse, None, *args,
            out.stride(0), out.stride(1), 0, out.stride(2),
            lse.stride(0), lse.stride(2), 0, lse.stride(1),
            SPLIT=False, **common,
        )
        return out, lse
    part_o = torch.empty(R, splits, h_q, d_v, dtype=torch.float32, device=dev)
    part_lse = torch.empty(R, splits, h_q, dtype=torch.float32, device=dev)
    _launch_sparse_mla_fwd[(R, head_blocks, splits)](
        q, kv_cache, idx, None, topk_length, part_o, part_lse, None, *args,
        s_q * part_o.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        s_q * part_lse.stride(0), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        SPLIT=True, **common,
    )
    merge_splits(part_o, part_lse, attn_sink, out, lse)
    return out, lse


# Launchers that reuse the compiled kernel per call signature (host time of eager calls).
_launch_sparse_mla_decode_merge = CachedLauncher(_sparse_mla_decode_merge_kernel)
_launch_sparse_mla_fwd = CachedLauncher(_sparse_mla_fwd_kernel)
