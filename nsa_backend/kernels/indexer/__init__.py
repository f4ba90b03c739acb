"""Lightning indexer kernels: the launchers, which pick a variant per call.

Variants (one module each):

- :mod:`.portable`: the ``tl`` kernels, ragged (prefill) and paged (decode) fp8 MQA logits, for every
  architecture and the CPU interpreter;
- :mod:`.sm90_gluon_paged`: the paged logits as a Gluon kernel on sm_90 (taken by
  :func:`fp8_paged_mqa_logits_triton` where its ``supported`` accepts the call);
- :mod:`.sm89_gluon_paged`: the paged logits of one to four query rows as a Gluon mma.sync kernel on sm_89 / 120 / 121
  (likewise);
- :mod:`.fp4`: the DeepSeek-V4 indexer over an MXFP4 key cache (``tl``, every architecture).
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs import indexer as cfgs
from nsa_backend.kernels._arch import device_arch, device_sms
from nsa_backend.kernels._launch import CachedLauncher, cdiv
from nsa_backend.kernels.indexer import sm89_gluon_paged as mma_v2_paged
from nsa_backend.kernels.indexer import sm90_gluon_paged as gluon_paged
from nsa_backend.kernels.indexer.fp4 import fp8_fp4_mqa_logits_triton, fp8_fp4_paged_mqa_logits_triton
from nsa_backend.kernels.indexer.portable import (
    DECODE_SCALE,
    _indexer_paged_logits_kernel,
    _indexer_paged_schedule_kernel,
    _indexer_ragged_logits_kernel,
)
from nsa_backend.reference import PAGED_SCHEDULE_SPLIT_KV

# Launches reusing the compiled kernel per call signature (host time of eager decode steps).
_launch_indexer_ragged_logits = CachedLauncher(_indexer_ragged_logits_kernel)
_launch_indexer_paged_schedule = CachedLauncher(_indexer_paged_schedule_kernel)
_launch_indexer_paged_logits = CachedLauncher(_indexer_paged_logits_kernel)

__all__ = [
    "fp8_fp4_mqa_logits_triton",
    "fp8_fp4_paged_mqa_logits_triton",
    "fp8_mqa_logits_triton",
    "fp8_paged_mqa_logits_triton",
    "get_paged_mqa_logits_metadata_triton",
]


def _fp8_operand(x: torch.Tensor, native: bool) -> torch.Tensor:
    return x if native else x.view(torch.uint8)


def _reg_cap(cfg: cfgs.LogitsConfig) -> dict[str, int]:
    return {"maxnreg": cfg.max_regs} if cfg.max_regs else {}


def fp8_mqa_logits_triton(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    *,
    config: cfgs.LogitsConfig | None = None,
) -> torch.Tensor:
    """Triton ``fp8_mqa_logits`` (see :func:`nsa_backend.fp8_mqa_logits`), on validated inputs.

    Parameters
    ----------
    q : torch.Tensor
        ``[S, H, D]`` ``float8_e4m3fn``, contiguous.
    kv : tuple of torch.Tensor
        ``(k [N, D] float8_e4m3fn, k_scale [N] float32)``.
    weights : torch.Tensor
        ``[S, H]`` ``float32``.
    cu_seq_len_k_start, cu_seq_len_k_end : torch.Tensor
        ``[S]`` ``int32``: row ``i`` sees keys ``[start[i], end[i])``.
    clean_logits : bool
        Write ``-inf`` outside each row's window.
    max_seqlen_k : int
        When > 0, the compressed layout: ``out[i, j] = logits[i, start[i] + j]``.
    config : LogitsConfig, optional
        Launch configuration overriding ``nsa_backend.configs.indexer.ragged_config``.

    Returns
    -------
    torch.Tensor
        ``[S, N]`` (or ``[S, max_seqlen_k]``) ``float32``.
    """
    k, k_scale = kv
    S, H, D = q.shape
    N = k.shape[0]
    cols = max_seqlen_k if max_seqlen_k > 0 else N
    out = torch.empty(S, cols, dtype=torch.float32, device=q.device)
    if S == 0 or cols == 0:
        return out
    arch = device_arch(q.device)
    native = cfgs.fp8_native(arch)
    cfg = config or cfgs.ragged_config(H, D, arch)
    hp = cfgs.padded_heads(H)
    bq = max(1, cfg.cols // hp)
    grid = (cdiv(S, bq),)
    _launch_indexer_ragged_logits[grid](
        _fp8_operand(q, native), _fp8_operand(k, native), k_scale, weights,
        cu_seq_len_k_start, cu_seq_len_k_end, out,
        S, N, H, out.stride(0), max_seqlen_k, 1.0 if native else DECODE_SCALE,
        D=D, HP=hp, BQ=bq, BLOCK_N=cfg.block_n, CLEAN=bool(clean_logits), FP8_NATIVE=native,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_reg_cap(cfg),
    )
    return out


def get_paged_mqa_logits_metadata_triton(
    context_lens: torch.Tensor, block_kv: int, num_sms: int
) -> torch.Tensor:
    """Triton ``get_paged_mqa_logits_metadata``: one program, no host synchronisation.

    Parameters
    ----------
    context_lens : torch.Tensor
        ``[B]`` or ``[B, next_n]`` ``int32``.
    block_kv : int
        Page size of the key cache; accepted for the op's signature (the schedule is in segments
        of ``PAGED_SCHEDULE_SPLIT_KV`` keys whatever the page size).
    num_sms : int
        Number of workers to schedule.

    Returns
    -------
    torch.Tensor
        ``[num_sms + 1, 2]`` ``int32``: the ``(request, segment)`` where each worker starts, then
        the end sentinel.
    """
    out = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)
    B = context_lens.shape[0]
    if context_lens.dim() == 2:
        stride, offset = context_lens.shape[1], max(context_lens.shape[1] - 1, 0)
        if context_lens.shape[1] == 0:
            B = 0
    else:
        stride, offset = 1, 0
    block_b = min(1024, max(16, triton.next_power_of_2(max(B, 1))))
    _launch_indexer_paged_schedule[(1,)](
        context_lens, out, B, stride, offset, num_sms,
        SPLIT=PAGED_SCHEDULE_SPLIT_KV, BLOCK_B=block_b, BLOCK_SM=64 if block_b <= 256 else 16, num_warps=4,
    )
    return out


def fp8_paged_mqa_logits_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    config: cfgs.LogitsConfig | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Triton ``fp8_paged_mqa_logits`` (see :func:`nsa_backend.fp8_paged_mqa_logits`), on validated inputs.

    Every output entry is written: logits for visible keys, ``-inf`` elsewhere.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, next_n, H, D]`` ``float8_e4m3fn``, contiguous.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, page, 1, D + 4]`` (or ``[num_blocks, page, D + 4]``): per page the
        ``page * D`` e4m3 values, then ``page`` fp32 scales; ``stride(0)`` may be padded.
    weights : torch.Tensor
        ``[B * next_n, H]`` ``float32``.
    context_lens : torch.Tensor
        ``[B]`` or ``[B, next_n]`` ``int32``.
    block_table : torch.Tensor
        ``[B, max_blocks]`` ``int32`` page ids.
    schedule_meta : torch.Tensor
        ``[num_sms + 1, 2]`` ``int32``; accepted for the op's signature, not needed by the kernel.
    max_context_len : int
        Output columns.
    clean_logits : bool
        Accepted for the op's signature: keys that are not visible are always ``-inf``.
    config : LogitsConfig, optional
        Launch configuration overriding ``nsa_backend.configs.indexer.paged_config``.
    chunk : int, optional
        Keys per program overriding ``nsa_backend.configs.indexer.paged_chunk``. Without ``config``
        and ``chunk``, calls that ``nsa_backend.kernels.indexer.sm89_gluon_paged.supported`` accepts (sm_89 / 120
        / 121 with Gluon, ``next_n`` 1 with 17..64 heads or 2..4 with 1..64) run that Gluon kernel, and calls that
        ``nsa_backend.kernels.indexer.sm90_gluon_paged.supported`` accepts
        (sm_90, ``D`` 128, pages of 64 keys, the ``next_n`` and head counts of the Gluon tables in
        ``nsa_backend.configs.indexer``) run the Gluon kernel instead.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]`` ``float32``.
    """
    B, next_n, H, D = q.shape
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    arch = device_arch(q.device)
    if config is None and chunk is None and arch is not None:
        if mma_v2_paged.supported(q, kv_cache, arch):
            return mma_v2_paged.fp8_paged_mqa_logits_mma_v2(q, kv_cache, weights, context_lens, block_table,
                                                            max_context_len)
        if gluon_paged.supported(q, kv_cache, arch):
            return gluon_paged.fp8_paged_mqa_logits_gluon(q, kv_cache, weights, context_lens, block_table,
                                                          max_context_len)
    num_pages, page = kv_cache.shape[0], kv_cache.shape[1]
    out = torch.empty(B * next_n, max_context_len, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if block_table.shape[1] == 0 or num_pages == 0:  # no page: no visible key
        return out.fill_(float("-inf"))
    native = cfgs.fp8_native(arch)
    cfg = config or cfgs.paged_config(H, next_n, D, arch)
    block_n = cfg.block_n
    chunk = chunk or cfgs.paged_chunk(B, max_context_len, device_sms(q.device), block_n, cfg.resident)
    chunk = cdiv(chunk, block_n) * block_n  # tiles start at multiples of block_n
    stride_page = kv_cache.stride(0)
    aligned = stride_page % 4 == 0 and kv_cache.data_ptr() % 4 == 0
    hp = cfgs.padded_heads(H)
    if hp // cfg.head_slices < 16:
        raise ValueError(f"config.head_slices: {cfg.head_slices} slices need at least {16 * cfg.head_slices} "
                         f"padded heads (16 per product), got {hp} for {H} heads")
    rows = max(1, cfg.cols // hp)
    grid = (B * cdiv(next_n, rows), cdiv(max_context_len, chunk))
    _launch_indexer_paged_logits[grid](
        _fp8_operand(q, native), kv_cache, weights, context_lens, block_table, out,
        H, max_context_len, num_pages, block_table.shape[1], block_table.stride(0), stride_page,
        out.stride(0),
        1.0 if native else DECODE_SCALE, next_n, chunk,
        NP=rows, D=D, HP=hp, PAGE=page, BLOCK_N=block_n,
        CTX_2D=context_lens.dim() == 2, FP8_NATIVE=native, SCALE_ALIGNED=aligned, SC_AHEAD=cfg.scale_ahead,
        ROW_LOOP=cfg.row_loop, HEAD_SLICES=cfg.head_slices,
        PG_AHEAD=cfg.scale_ahead and cfg.page_ahead and block_n == page, K_MASK=cfg.k_mask,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_reg_cap(cfg),
    )
    return out
