"""The split-K launch and merge of sparse MLA decode, shared by the ``tl`` path and the Gluon kernels.

``_sparse_mla_decode_merge_kernel`` combines the ``num_splits`` partial results of a query row:

    m = max_s lse_s,  w_s = 2^(lse_s - m),  out = sum_s w_s out_s / sum_s w_s,  lse = m + log2(sum_s w_s)

converts lse to natural log (``+inf`` for a row without a valid slot), applies ``attn_sink`` and
writes ``out [B, s_q, h_q, 512]`` bf16 and ``lse [B, h_q, s_q]``. :func:`launch_split_decode` launches a decode
kernel of the common calling convention with one split (final outputs) or several (partials, then the merge).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from nsa_backend import envs
from nsa_backend.configs.sparse_mla import MERGE_BLOCK_H, MERGE_NUM_WARPS, merge_block_d
from nsa_backend.kernels._arch import device_capability, device_sms
from nsa_backend.kernels._launch import CachedLauncher, cdiv
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_bf16

try:  # grid dependency control (Triton >= 3.4 on CUDA)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older Triton: plain launches
    gdc_wait = None

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


# Launch reusing the compiled kernel per call signature (host time of eager decode steps).
_launch_merge = CachedLauncher(_sparse_mla_decode_merge_kernel)


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
    head_blocks = cdiv(h_q, MERGE_BLOCK_H)
    block_d = merge_block_d(R * head_blocks, d_v, device_sms(part_o.device))
    pdl = merge_pdl(part_o.device)
    _launch_merge[(R, head_blocks, d_v // block_d)](
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


def decode_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised results of a decode launch on ``q [B, s_q, h_q, d_qk]``: ``out [B, s_q, h_q, d_v]`` bfloat16
    and ``lse [B, h_q, s_q]`` float32."""
    B, s_q, h_q, _ = q.shape
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=q.device)
    return out, lse


def launch_split_decode(
    launch: Any,
    head_blocks: int,
    splits: int,
    inputs: tuple,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    args: tuple,
    options: Callable[[bool], dict[str, Any]],
    after_lse: tuple = (),
    grid: str = "heads_rows",
) -> None:
    """Launch a decode kernel on the grid ``(head_blocks, B * s_q, splits)`` (``grid="heads_rows"``),
    ``(B * s_q, head_blocks, splits)`` (``"rows_heads"``) or ``(B * s_q * head_blocks, splits)`` (``"flat"``, the
    head blocks of a row neighbours) and, with several splits, merge.

    The kernel takes ``(*inputs, sink_ptr, topk_len_ptr, out_ptr, lse_ptr, *after_lse, *args)``, then the
    strides of its output by batch, query position, split and head, and the same four of its lse. With one split
    it writes ``out`` and ``lse`` itself (with ``attn_sink``); with several, fp32 partials ``[R, splits, h_q, d_v]``
    and their base-2 lse (no sink), which :func:`merge_splits` combines. ``options(split)`` gives the launch's
    keyword arguments for either case.
    """
    B, s_q, h_q, d_v = out.shape
    R = B * s_q
    programs = {"heads_rows": (head_blocks, R), "rows_heads": (R, head_blocks), "flat": (R * head_blocks,)}[grid]
    if splits == 1:
        launch[(*programs, 1)](
            *inputs, attn_sink, topk_length, out, lse, *after_lse, *args,
            out.stride(0), out.stride(1), 0, out.stride(2),
            lse.stride(0), lse.stride(2), 0, lse.stride(1),
            **options(False),
        )
        return
    part_o = torch.empty(R, splits, h_q, d_v, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(R, splits, h_q, dtype=torch.float32, device=out.device)
    launch[(*programs, splits)](
        *inputs, None, topk_length, part_o, part_lse, *after_lse, *args,
        s_q * part_o.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        s_q * part_lse.stride(0), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        **options(True),
    )
    merge_splits(part_o, part_lse, attn_sink, out, lse)
