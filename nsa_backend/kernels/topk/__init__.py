"""Top-k selection kernels: the launchers, which pick a path per call.

:mod:`.portable` holds the ``tl`` kernels (every architecture and the CPU interpreter); the module
docstring there describes the paths (register-resident, sieve, whole-row and split) and
``nsa_backend.configs.topk`` the rules that choose between them.
"""

from __future__ import annotations

import torch

from nsa_backend.configs import topk as cfgs
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._launch import CachedLauncher, cdiv
from nsa_backend.kernels.topk.portable import (
    _topk_filter_kernel,
    _topk_finish_kernel,
    _topk_histogram_kernel,
    _topk_logical_to_global_kernel,
    _topk_resident_kernel,
    _topk_row_kernel,
    _topk_sieve_kernel,
    _topk_sieve_merge_kernel,
    _topk_sieve_part_kernel,
)

# Launches reusing the compiled kernel per call signature (host time of eager decode steps).
_launch_topk_row = CachedLauncher(_topk_row_kernel)
_launch_topk_sieve_part = CachedLauncher(_topk_sieve_part_kernel)
_launch_topk_sieve_merge = CachedLauncher(_topk_sieve_merge_kernel)
_launch_topk_sieve = CachedLauncher(_topk_sieve_kernel)
_launch_topk_resident = CachedLauncher(_topk_resident_kernel)
_launch_topk_histogram = CachedLauncher(_topk_histogram_kernel)
_launch_topk_filter = CachedLauncher(_topk_filter_kernel)
_launch_topk_finish = CachedLauncher(_topk_finish_kernel)
_launch_topk_logical_to_global = CachedLauncher(_topk_logical_to_global_kernel)

__all__ = ["logical_to_global_indices_triton", "topk_indices_triton"]


def topk_indices_triton(
    logits: torch.Tensor,
    topk: int,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    *,
    config: cfgs.TopkConfig | cfgs.RowConfig | cfgs.ResidentConfig | cfgs.SieveConfig | None = None,
) -> torch.Tensor:
    """Triton ``topk_indices`` (see :func:`nsa_backend.topk_indices`), on validated inputs.

    The register-resident path (one launch of ``_topk_resident_kernel``), the sieve path (one
    launch of ``_topk_sieve_kernel``, or ``_topk_sieve_part_kernel`` and ``_topk_sieve_merge_kernel``
    with rows split over parts), the whole-row path (one launch of ``_topk_row_kernel``) or the
    split path (four launches), as :func:`nsa_backend.configs.topk.use_resident_path`,
    ``use_sieve_path`` and ``use_row_path`` decide. No host synchronisation; allocations sized by
    shapes only.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, N]`` ``float32``.
    topk : int
        Indices per row.
    starts, ends : torch.Tensor, optional
        ``[R]`` ``int32``: row ``i`` selects among columns ``[starts[i], ends[i])`` (default ``0`` and ``N``).
    config : ResidentConfig, SieveConfig, RowConfig or TopkConfig, optional
        Launch configuration overriding the automatic choice: a ``ResidentConfig`` runs the
        register-resident path, a ``SieveConfig`` the sieve path, a ``RowConfig`` the whole-row
        path (these three ``topk <= ROW_MAX_TOPK`` only), a ``TopkConfig`` the split path.

    Returns
    -------
    torch.Tensor
        ``[R, topk]`` ``int32`` column indices, ``-1`` padded when a row has fewer valid columns.
    """
    R, N = logits.shape
    out = torch.empty(R, topk, dtype=torch.int32, device=logits.device)
    if R == 0:
        return out
    if config is None:
        if cfgs.use_resident_path(N, R, topk):
            config = cfgs.resident_config(N, R)
        elif cfgs.use_sieve_path(N, R, topk):
            config = cfgs.sieve_config(N, R, device_sms(logits.device))
        elif cfgs.use_row_path(N, R, topk):
            config = cfgs.row_config(N, R)
        else:
            config = cfgs.topk_config(N, R)
    if isinstance(config, cfgs.SieveConfig):
        _topk_sieve(logits, topk, starts, ends, out, config)
    elif isinstance(config, cfgs.ResidentConfig):
        _topk_resident(logits, topk, starts, ends, out, config)
    elif isinstance(config, cfgs.RowConfig):
        _topk_rows(logits, topk, starts, ends, out, config)
    else:
        _topk_split(logits, topk, starts, ends, out, config)
    return out


def _persistent_grid(logits, out, programs_per_sm, slab, needs_slab):
    """Programs of a persistent row kernel and their scratch: one ``[2, slab]`` int32 slab (keys,
    columns) per program when rows can outgrow the registers, else ``out`` as a placeholder."""
    programs = max(1, min(logits.shape[0], programs_per_sm * device_sms(logits.device)))
    if not needs_slab:
        return programs, out
    return programs, torch.empty(programs, 2, slab, dtype=torch.int32, device=logits.device)


def _topk_rows(logits, topk, starts, ends, out, cfg):
    R, N = logits.shape
    cap = cfgs.row_capacity(topk, cfg)
    # slab: a long row's candidates
    programs, scratch = _persistent_grid(logits, out, cfg.programs_per_sm, cap, N > cap)
    _launch_topk_row[(programs,)](
        logits, out, scratch, starts, ends, R, N, topk, logits.stride(0),
        BLOCK=cfg.block, CAP=cap, SAMPLE=cfgs.row_sample(cap), SIGMAS=cfgs.ROW_SIGMAS, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps,
    )


def _topk_sieve(logits, topk, starts, ends, out, cfg):
    R, N = logits.shape
    cap, sample, direct = cfgs.sieve_sizes(topk, cfg)
    if cfg.split > 1:
        # rows split over parts: lists and per-row state (length, maximum key >> 1, bound)
        scratch = torch.empty(R, 2, cap, dtype=torch.int32, device=logits.device)
        state = torch.zeros(R, 4, dtype=torch.int32, device=logits.device)
        _launch_topk_sieve_part[(R, cfg.split)](
            logits, scratch, state, starts, ends, N, topk, logits.stride(0),
            BLOCK=cfg.block, CAP=cap, SAMPLE=sample, DIRECT=direct, SIGMAS=cfgs.ROW_SIGMAS,
            num_warps=cfg.num_warps,
        )
        _launch_topk_sieve_merge[(R,)](
            logits, out, scratch, state, starts, ends, N, topk, logits.stride(0),
            BLOCK=cfg.merge_block, CAP=cap, num_warps=cfg.merge_warps,
        )
        return
    # slab: a row's candidate list
    programs, scratch = _persistent_grid(logits, out, cfg.programs_per_sm, cap, True)
    _launch_topk_sieve[(programs,)](
        logits, out, scratch, starts, ends, R, N, topk, logits.stride(0),
        BLOCK=cfg.block, LIST_BLOCK=cfg.list_block or cfg.block, CAP=cap, SAMPLE=sample, DIRECT=direct,
        SIGMAS=cfgs.ROW_SIGMAS, num_warps=cfg.num_warps, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
    )


def _topk_resident(logits, topk, starts, ends, out, cfg):
    R, N = logits.shape
    cap, fin = cfgs.resident_sizes(N, topk, cfg)
    # slab: a long row's chunk winners
    programs, scratch = _persistent_grid(logits, out, cfg.programs_per_sm, fin, N > cap)
    _launch_topk_resident[(programs,)](
        logits, out, scratch, starts, ends, R, N, topk, logits.stride(0),
        CAP=cap, FIN=fin, EMIT_BLOCK=cfg.emit_block, num_warps=cfg.num_warps,
    )


def _topk_split(logits, topk, starts, ends, out, cfg):
    R, N = logits.shape
    split = cfgs.row_split(R, N, cfg.block, device_sms(logits.device))
    zeroed = torch.zeros(R * (512 + 2), dtype=torch.int32, device=logits.device)
    hist = zeroed[:R * 512].view(R, 512)  # two 256-bin histograms per row (key bits 31..24, 23..16)
    counters = zeroed[R * 512:].view(R, 2)  # keys written to the output / to the candidate list
    cap = cfgs.candidate_capacity(N)
    cand = torch.empty(R, cap, dtype=torch.int32, device=logits.device)
    stride = logits.stride(0)
    for level in (0, 1):
        _launch_topk_histogram[(R, split)](logits, hist, starts, ends, N, topk, stride, split,
                                           BLOCK=cfg.block, LEVEL=level, num_warps=cfg.num_warps)
    _launch_topk_filter[(R, split)](logits, hist, counters, cand, out, starts, ends, N, topk, stride, split,
                                    cap, BLOCK=cfg.block, num_warps=cfg.num_warps)
    _launch_topk_finish[(R,)](logits, hist, cand, out, starts, ends, N, topk, stride, cap,
                              BLOCK=cfgs.FINISH_BLOCK, num_warps=cfgs.FINISH_NUM_WARPS)


def logical_to_global_indices_triton(
    indices: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Triton ``logical_to_global_indices`` (see :func:`nsa_backend.logical_to_global_indices`).

    Parameters
    ----------
    indices : torch.Tensor
        ``[R, K]`` ``int32`` key positions inside each row's request (``-1``: none).
    block_table : torch.Tensor
        ``[B, M]`` ``int32`` page ids.
    req_ids : torch.Tensor
        ``[R]`` ``int32`` request of each row.
    page_size : int
        Tokens per page.

    Returns
    -------
    torch.Tensor
        ``[R, K]`` ``int32`` cache slots ``block_table[req, pos // page_size] * page_size + pos % page_size``;
        ``-1`` for negative positions, pages past the table and negative table entries.
    """
    R, K = indices.shape
    out = torch.empty_like(indices)
    if out.numel() == 0:
        return out
    B, M = block_table.shape
    grid = (R, cdiv(K, cfgs.L2G_BLOCK))
    _launch_topk_logical_to_global[grid](
        indices, block_table, req_ids, out, K, B, M, block_table.stride(0), page_size,
        BLOCK=cfgs.L2G_BLOCK, num_warps=cfgs.L2G_NUM_WARPS,
    )
    return out
