"""mHC pre-norm GEMM kernels: the launcher (:func:`tf32_hc_prenorm_gemm_triton`), its split plan and the
ahead-of-time compile of the shipped configurations.

:mod:`.portable` holds the ``tl`` kernels and describes the two paths (stacked ``b`` parts, in-loop split);
:mod:`.sm80_gluon` the stacked-parts GEMM in Gluon that the mma.sync archs take where Gluon runs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton

from nsa_backend import envs
from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels._arch import device_arch, device_capability, device_sms
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable
from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT, compile_for_arch
from nsa_backend.kernels.mhc import sm80_gluon
from nsa_backend.kernels.mhc.portable import (
    _mhc_prenorm_gemm_kernel,
    _mhc_prenorm_reduce_kernel,
    _mhc_prenorm_split_b_kernel,
    _num_parts,
    _parts_tile,
)

__all__ = ["Variant", "even_k_variants", "shipped_variants", "split_plan", "tf32_hc_prenorm_gemm_triton"]


def _arch_and_sms(device: torch.device) -> tuple[int | None, int]:
    if device.type != "cuda":
        return None, 4
    arch, sms = device_arch(device), device_sms(device)
    if arch not in SHARED_MEMORY_LIMIT:
        arch = None
    return arch, sms


def split_plan(
    m: int,
    n: int,
    k: int,
    num_splits: int,
    block_m: int,
    block_k: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    min_chunk_k: int | None = None,
) -> tuple[int, int, int]:
    """``(split_k, chunk_k, num_chunks)``: how K is cut across programs.

    ``split_k`` (a multiple of 64) is the width of each of the caller's ``num_splits`` parts, as in
    ``nsa_backend.reference.split_bounds``. Each part is cut into ``num_chunks`` chunks of
    ``chunk_k`` columns (a multiple of ``block_k``, at least ``MIN_CHUNK_K`` when cut). The count
    minimises a bytes-per-slot cost: programs run in waves of ``PROGRAMS_PER_SM * num_sms``, each
    reading ``block_m * (chunk_k + PROGRAM_OVERHEAD_K)`` bf16 values, plus the fp32 partial sums
    written and read back when a part is cut.
    """
    split_k = 64 * triton.cdiv(k // 64, num_splits)
    tiles = triton.cdiv(m, block_m) * num_splits
    slots = (programs_per_sm or cfgs.PROGRAMS_PER_SM) * num_sms
    most = max(1, split_k // (min_chunk_k or cfgs.MIN_CHUNK_K))
    best: tuple[float, int, int] | None = None
    for want in range(1, most + 1):
        chunk_k = block_k * triton.cdiv(triton.cdiv(split_k, want), block_k)
        chunks = triton.cdiv(split_k, chunk_k)
        waves = triton.cdiv(tiles * chunks, slots)
        cost = waves * (chunk_k + cfgs.PROGRAM_OVERHEAD_K) * block_m * 2
        if chunks > 1:
            cost += chunks * num_splits * m * (n + 1) * 8 / slots
        if best is None or cost < best[0]:
            best = (cost, chunk_k, chunks)
    assert best is not None
    return split_k, best[1], best[2]


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, num_splits: int, device_index: int | None, gluon_on: bool = False
          ) -> tuple[int, cfgs.GemmConfig, tuple[int, int, int], bool, bool]:
    """``(block_n, config, (split_k, chunk_k, num_chunks), b_parts, gluon)`` of the default precision;
    ``gluon_on``: the Gluon stacked-parts kernel may run on this device (``gluon``: it does)."""
    device = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
    arch, sms = _arch_and_sms(device)
    block_n, config = cfgs.gemm_config(n, m, arch)
    b_parts = cfgs.uses_b_parts(block_n, m, arch)
    gluon = b_parts and gluon_on and arch in cfgs.GLUON_PARTS_ARCHS
    if gluon:
        config, per_sm = cfgs.GLUON_PARTS_ROUTE
    else:
        per_sm = cfgs.parts_route(m, arch)[1] if b_parts else cfgs.PROGRAMS_PER_SM
    plan = split_plan(m, n, k, num_splits, config.block_m, config.block_k, sms, per_sm)
    gluon = gluon and sm80_gluon.usable(arch, block_n, cfgs.PARTS_PRECISION, k, plan[0], plan[1], config.block_k)
    return block_n, config, plan, b_parts, gluon


@functools.cache
def _triton_version() -> tuple[int, int]:
    major, minor = (int("".join(ch for ch in piece if ch.isdigit()) or 0)
                    for piece in [*triton.__version__.split("."), "0"][:2])
    return major, minor


def _pdl_enabled(arch: int | None) -> bool:
    """Whether the stacked-parts kernels of ``sm_<arch>`` use programmatic dependent launch."""
    return arch in cfgs.PDL_ARCHS and _triton_version() >= cfgs.PDL_MIN_TRITON


def _split_b(b: torch.Tensor, precision: str = "bf16x3", pdl: bool = False,
             zero_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[P, N, K]`` bf16 parts of the fp32 ``b``: ``b = hi + mid + lo`` (``bf16x3``) or
    ``b ~ hi + lo`` (``bf16x2``). ``pdl``: the next kernel (launched with programmatic dependent
    launch) may start early. ``zero_out``: ``(d, sqr_sum)`` (contiguous fp32) zeroed by the same
    launch."""
    N, K = b.shape
    parts = torch.empty((_num_parts(precision), N, K), dtype=torch.bfloat16, device=b.device)
    d, sq = zero_out if zero_out is not None else (b, b)
    d_numel, sq_numel = (d.numel(), sq.numel()) if zero_out is not None else (0, 0)
    grid = (triton.cdiv(max(N * K, d_numel), cfgs.SPLIT_B_BLOCK),)
    _mhc_prenorm_split_b_kernel[grid](b, parts, N * K, d, d_numel, sq, sq_numel, NUM_PARTS=_num_parts(precision),
                                      BLOCK=cfgs.SPLIT_B_BLOCK, USE_PDL=pdl, ZERO_OUT=zero_out is not None,
                                      num_warps=cfgs.SPLIT_B_NUM_WARPS)
    return parts


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int,
    block_n: int,
    config: cfgs.GemmConfig,
    plan: tuple[int, int, int],
    precision: str,
    b_parts: bool = False,
    pdl: bool = False,
    atomic_sums: bool = False,
    sync_mma: bool | None = None,
    gluon: bool = False,
) -> None:
    """Launch the kernels for ``d [S, M, N]`` and ``sqr_sum [S, M]`` (``S = num_splits``).

    With ``b_parts`` (``bf16x3`` or ``bf16x2``) ``b`` is split into its stacked bf16 parts by a first
    kernel; K chunks (``plan``) are added by a last kernel, or, with ``atomic_sums`` (stacked parts
    only), by the GEMM programs themselves with fp32 atomics into ``d`` and ``sqr_sum``, which the
    split kernel zeroes first (one launch less; the order of the additions, and so the last bits,
    then vary from call to call). With ``pdl`` (stacked parts, sm_90+) the GEMM and reduction kernels
    are launched with programmatic dependent launch: each starts while the kernel before it runs and
    waits for it in-kernel, which hides the launch gaps between them. ``sync_mma`` (stacked parts): wait
    for each step's product in its step; ``None`` decides by what ``tl.dot`` lowers to on this GPU
    (:func:`nsa_backend.configs.mhc.sync_mma`). ``gluon`` (stacked ``bf16x2`` parts, K ranges in whole
    ``config.block_k`` steps: :func:`nsa_backend.kernels.mhc.sm80_gluon.usable`): the GEMM is the Gluon
    kernel, launched without programmatic dependent launch.
    """
    M, K = a.shape
    N = b.shape[0]
    split_k, chunk_k, num_chunks = plan
    slots = num_splits * num_chunks
    b_parts = b_parts and precision in ("bf16x3", "bf16x2")
    pdl = pdl and b_parts and not envs.triton_interpret()
    atomic_sums = atomic_sums and b_parts and num_chunks > 1
    if num_chunks == 1 or atomic_sums:
        out_d, out_sq, stride_dt, stride_st = d, sqr_sum, M * N, M
    else:
        ws = torch.empty((slots, M * N + M), dtype=torch.float32, device=a.device)
        out_d, out_sq, stride_dt, stride_st = ws, ws[:, M * N:], M * N + M, M * N + M
    if sync_mma is None:
        sync_mma = cfgs.sync_mma(device_capability(a.device), envs.triton_mma_v3_disabled())
    gluon = gluon and b_parts and precision == "bf16x2"
    pdl = pdl and not gluon
    b_in = _split_b(b, precision, pdl, (d, sqr_sum) if atomic_sums else None) if b_parts else b
    grid = (triton.cdiv(M, config.block_m), slots)
    if gluon:
        sm80_gluon.kernel()[grid](
            a, b_in, out_d, out_sq, M, N, K, split_k, chunk_k, num_chunks, stride_dt, stride_st,
            BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
            NUM_WARPS=config.num_warps, ATOMIC_SUMS=atomic_sums, num_warps=config.num_warps,
            maxnreg=cfgs.GLUON_PARTS_MAX_REGS,
        )
    else:
        _mhc_prenorm_gemm_kernel[grid](
            a, b_in, out_d, out_sq, M, N, K, split_k, chunk_k, num_chunks, stride_dt, stride_st,
            BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=config.block_k, PRECISION=precision, B_PARTS=b_parts,
            SQ_2D=b_parts, USE_PDL=pdl, LATE_DEPENDENTS=cfgs.LATE_DEPENDENTS, ATOMIC_SUMS=atomic_sums,
            SYNC_MMA=sync_mma, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        )
    if num_chunks > 1 and not atomic_sums:
        block_j, block = cfgs.reduce_blocks(num_chunks)
        grid = (triton.cdiv(M * N + M, block), num_splits)
        _mhc_prenorm_reduce_kernel[grid](ws, d, sqr_sum, M, N, num_chunks, BLOCK=block, BLOCK_J=block_j,
                                        USE_PDL=pdl, num_warps=cfgs.REDUCE_NUM_WARPS, launch_pdl=pdl)


def tf32_hc_prenorm_gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """Triton ``d = a @ b.T`` and ``sqr_sum = sum(a^2, -1)``, written in place (validated inputs).

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K]`` bf16, contiguous, ``K % 64 == 0``.
    b : torch.Tensor
        ``[N, K]`` fp32, contiguous, ``N % 8 == 0``, ``N <= 128``.
    d : torch.Tensor
        ``[M, N]`` fp32, or ``[S, M, N]`` with ``S = num_splits`` (partial sums over K).
    sqr_sum : torch.Tensor
        ``[M]`` fp32, or ``[S, M]`` with ``num_splits``.
    num_splits : int, optional
        Number of K partitions; split ``s`` covers the same K range as
        ``nsa_backend.reference.split_bounds(K, S)[s]`` (trailing splits may be empty: zeros).

    Notes
    -----
    Precision (``nsa_backend.configs.mhc.DEFAULT_PRECISION``), measured on an H200 against the
    fp32 reference for M = 2048, N = 24, K = 28672 (error = max |d - ref| / RMS(ref)):

    - ``"bf16x3"`` (default): ``b`` is split into three bf16 parts, each multiplied exactly with
      the bf16 ``a`` and accumulated in fp32, i.e. better than TF32 and about fp32: error
      ``1.4e-5`` (up to ``6.4e-5`` at M = 8192, N = 128, K = 7168 in the GPU fuzz; the fp32
      reference's own rounding is of that order), ``calc_diff`` against an fp64 product ``5e-12``.
    - ``"tf32"`` (DeepGEMM's choice): ``a`` is exact in TF32, ``b`` is rounded to TF32 (10-bit
      mantissa): error ``1.8e-3`` (``2.6e-3`` at most over a 240-case fuzz), ``calc_diff`` ``9e-8``.
      It was 1.6-2x slower than ``"bf16x3"`` on the H200.

    ``sqr_sum`` is an fp32 sum on CUDA cores in every mode (error ``3e-7`` of its RMS).

    With the stacked parts (N in 17..32 on ``PARTS_ARCHS``) ``PARTS_PRECISION = "bf16x2"`` keeps 16
    significant bits of ``b`` (``|b - hi - lo| <= 2^-16 |b|``; TF32 keeps 11): H200 error against the
    fp32 reference 1.3e-5 / 2.0e-5 / 4.2e-5 / 8.6e-5 / 1.7e-4 of the output RMS at M = 1024 / 2048 /
    4096 / 8192 / 16384 (N = 24, K = 28672), against 8.8e-6 / 1.8e-5 / 4.1e-5 / 8.5e-5 / 1.7e-4 for
    three parts in the same run: the reference's own fp32 rounding dominates both.

    Determinism: where K is cut into chunks on the stacked-parts path, the chunks' partial sums are
    added with fp32 atomics (``nsa_backend.configs.mhc.ATOMIC_CHUNK_SUMS``), so the last bits may
    differ from call to call; under ``torch.use_deterministic_algorithms(True)`` a second kernel adds
    them in a fixed order instead (bit-identical results, one launch more: 0.68-0.69 instead of
    0.70-0.71 of the copy rate at M = 2048 on the H200). Every other path is deterministic.
    """
    M, K = a.shape
    N = b.shape[0]
    if M == 0:
        return
    splits = 1 if num_splits is None else num_splits
    index = None
    if a.device.type == "cuda":
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    arch = device_arch(a.device) if index is not None else None
    block_n, config, plan, b_parts, gluon = _plan(M, N, K, splits, index,
                                                  gluon_enabled(arch, cfgs.GLUON_PARTS_ARCHS))
    precision = cfgs.PARTS_PRECISION if b_parts else cfgs.DEFAULT_PRECISION
    pdl = b_parts and index is not None and _pdl_enabled(arch)
    atomic_sums = cfgs.ATOMIC_CHUNK_SUMS and not torch.are_deterministic_algorithms_enabled()
    _launch(a, b, d, sqr_sum, splits, block_n, config, plan, precision, b_parts, pdl, atomic_sums, gluon=gluon)


_GEMM_SIGNATURE: dict[str, str] = {
    "a_ptr": "*bf16", "b_ptr": "*fp32", "d_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
    "SPLIT_K": "i32", "CHUNK_K": "i32", "NUM_CHUNKS": "i32", "stride_dt": "i32", "stride_st": "i32",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRECISION": "constexpr",
    "B_PARTS": "constexpr", "SQ_2D": "constexpr", "USE_PDL": "constexpr", "LATE_DEPENDENTS": "constexpr",
    "EVEN_K": "constexpr", "PARTS_TILE": "constexpr", "BF16_DOT_AS_FP32": "constexpr", "SYNC_MMA": "constexpr",
    "ATOMIC_SUMS": "constexpr",
}
_SPLIT_B_SIGNATURE: dict[str, str] = {
    "b_ptr": "*fp32", "bp_ptr": "*bf16", "NK": "i32", "d_ptr": "*fp32", "D_NUMEL": "i32", "sq_ptr": "*fp32",
    "SQ_NUMEL": "i32", "NUM_PARTS": "constexpr", "BLOCK": "constexpr", "USE_PDL": "constexpr",
    "ZERO_OUT": "constexpr",
}
_GLUON_GEMM_SIGNATURE: dict[str, str] = {
    "a_ptr": "*bf16", "bp_ptr": "*bf16", "d_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
    "SPLIT_K": "i32", "CHUNK_K": "i32", "NUM_CHUNKS": "i32", "stride_dt": "i32", "stride_st": "i32",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "NUM_STAGES": "constexpr",
    "NUM_WARPS": "constexpr", "ATOMIC_SUMS": "constexpr",
}
_REDUCE_SIGNATURE: dict[str, str] = {
    "ws_ptr": "*fp32", "d_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32", "NUM_CHUNKS": "i32",
    "BLOCK": "constexpr", "BLOCK_J": "constexpr", "USE_PDL": "constexpr",
}


# Arguments Triton sees as multiples of 16 at run time (aligned pointers; K, SPLIT_K and CHUNK_K are
# multiples of 64): the ahead-of-time compile uses the same hints, so loads are vectorised and
# pipelined through shared memory as in the real launch, and the shared-memory figure is the real one.
_GEMM_DIVISIBLE: tuple[str, ...] = ("a_ptr", "b_ptr", "d_ptr", "sq_ptr", "K", "SPLIT_K", "CHUNK_K")
_GLUON_GEMM_DIVISIBLE: tuple[str, ...] = ("a_ptr", "bp_ptr", "d_ptr", "sq_ptr", "K", "SPLIT_K", "CHUNK_K")
_SPLIT_B_DIVISIBLE: tuple[str, ...] = ("b_ptr", "bp_ptr", "NK", "d_ptr", "sq_ptr")
_REDUCE_DIVISIBLE: tuple[str, ...] = ("ws_ptr", "d_ptr", "sq_ptr")


def _compile(kernel: Any, signature: dict[str, str], divisible: tuple[str, ...], constexprs: dict[str, Any],
             arch: int, num_warps: int, num_stages: int, options: dict[str, Any] | None = None) -> Any:
    return compile_for_arch(kernel, signature, constexprs, arch, num_warps, num_stages, aligned=divisible,
                            options=options)


def even_k_variants(block_k: int) -> tuple[bool, ...]:
    """The ``EVEN_K`` values launches of a tile with ``block_k`` columns per step can take.

    ``K`` and ``SPLIT_K`` are multiples of 64 and ``CHUNK_K`` of ``block_k``, so steps of at most 64
    columns always divide them; 128-column steps divide them only where ``K`` and the split do.
    """
    return (True,) if 64 % block_k == 0 else (True, False)


def _gemm_variant(block_n: int, cfg: cfgs.GemmConfig, precision: str, b_parts: bool, pdl: bool = False,
                  atomic_sums: bool = False, even_k: bool = True,
                  sync_mma: bool = cfgs.SYNC_MMA) -> tuple[dict[str, str], dict[str, Any]]:
    """Signature and constexprs of the GEMM kernel as :func:`_launch` runs it (``even_k``: one of
    :func:`even_k_variants`; ``sync_mma``: :func:`nsa_backend.configs.mhc.sync_mma` of the arch)."""
    b_parts = b_parts and precision in ("bf16x3", "bf16x2")
    signature = dict(_GEMM_SIGNATURE, b_ptr="*bf16" if b_parts else "*fp32")
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": block_n, "BLOCK_K": cfg.block_k, "PRECISION": precision,
                  "B_PARTS": b_parts, "SQ_2D": b_parts, "USE_PDL": pdl and b_parts,
                  "LATE_DEPENDENTS": cfgs.LATE_DEPENDENTS,
                  "EVEN_K": even_k, "PARTS_TILE": _parts_tile(precision),
                  "BF16_DOT_AS_FP32": False, "SYNC_MMA": sync_mma, "ATOMIC_SUMS": atomic_sums and b_parts}
    return signature, constexprs


class Variant(NamedTuple):
    """One ahead-of-time compilation shipped for an arch: which kernel, a readable label of its
    configuration, and what the launcher compiles it with."""

    kind: str
    label: str
    kernel: Any
    signature: dict[str, str]
    aligned: tuple[str, ...]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    options: dict[str, Any] | None = None  # further compile options the launcher passes (maxnreg)


def shipped_variants(arch: int) -> list[Variant]:
    """Every compilation of the GEMM, split-b and reduce kernels shipped for ``sm_<arch>``.

    The in-loop path's default precision with every configuration, the other precisions with the
    widest N tile (the most shared memory); the stacked-parts path with its precision and launch
    (``PARTS_PRECISION``, ``PDL_ARCHS``), its chunks stored or added by atomics; each tile in every
    ``EVEN_K`` variant it can launch (:func:`even_k_variants`); on ``GLUON_PARTS_ARCHS``, where this
    Triton has Gluon, the Gluon stacked-parts GEMM with its chunks stored or added by atomics.
    """
    out = []
    shipped = cfgs.shipped_configs(arch)
    pdl = _pdl_enabled(arch)
    for block_n, cfg, b_parts in shipped:
        precisions = [cfgs.PARTS_PRECISION] if b_parts else [
            p for p in cfgs.PRECISIONS if p == cfgs.DEFAULT_PRECISION or block_n == cfgs.BLOCK_N_BUCKETS[-1]]
        # The stacked parts also run with their chunks added by atomics (ATOMIC_CHUNK_SUMS).
        sums = (False, True) if b_parts and cfgs.ATOMIC_CHUNK_SUMS else (False,)
        for precision in precisions:
            for atomic_sums in sums:
                for even_k in even_k_variants(cfg.block_k):
                    signature, constexprs = _gemm_variant(block_n, cfg, precision, b_parts, pdl, atomic_sums,
                                                          even_k, cfgs.sync_mma(arch))
                    label = (f"BLOCK_N={block_n} BLOCK_M={cfg.block_m} BLOCK_K={cfg.block_k} {precision}"
                             f"{' parts' if b_parts else ''}{' atomic' if atomic_sums else ''}"
                             f"{'' if even_k else ' masked-K'} warps={cfg.num_warps} stages={cfg.num_stages}")
                    out.append(Variant("gemm", label, _mhc_prenorm_gemm_kernel, signature, _GEMM_DIVISIBLE,
                                       constexprs, cfg.num_warps, cfg.num_stages))
    parts = any(b_parts for _, _, b_parts in shipped)
    if parts and arch in cfgs.GLUON_PARTS_ARCHS and cfgs.PARTS_PRECISION == "bf16x2" and gluon_importable():
        cfg = cfgs.GLUON_PARTS_ROUTE[0]
        for atomic_sums in sorted({False, cfgs.ATOMIC_CHUNK_SUMS}):
            constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfgs.PARTS_BLOCK_N, "BLOCK_K": cfg.block_k,
                          "NUM_STAGES": cfg.num_stages, "NUM_WARPS": cfg.num_warps, "ATOMIC_SUMS": atomic_sums}
            label = (f"BLOCK_N={cfgs.PARTS_BLOCK_N} BLOCK_M={cfg.block_m} BLOCK_K={cfg.block_k} bf16x2 parts gluon"
                     f"{' atomic' if atomic_sums else ''} warps={cfg.num_warps} stages={cfg.num_stages}")
            out.append(Variant("gemm", label, sm80_gluon.kernel(), _GLUON_GEMM_SIGNATURE, _GLUON_GEMM_DIVISIBLE,
                               constexprs, cfg.num_warps, cfg.num_stages, {"maxnreg": cfgs.GLUON_PARTS_MAX_REGS}))
    if parts:
        for zero_out in sorted({False, cfgs.ATOMIC_CHUNK_SUMS}):
            constexprs = {"NUM_PARTS": _num_parts(cfgs.PARTS_PRECISION), "BLOCK": cfgs.SPLIT_B_BLOCK,
                          "USE_PDL": pdl, "ZERO_OUT": zero_out}
            out.append(Variant("split_b", f"ZERO_OUT={zero_out}", _mhc_prenorm_split_b_kernel, _SPLIT_B_SIGNATURE,
                               _SPLIT_B_DIVISIBLE, constexprs, cfgs.SPLIT_B_NUM_WARPS, 3))
    for use_pdl in sorted({False, parts and pdl}):
        for block_j, block in cfgs.shipped_reduce_blocks():
            out.append(Variant("reduce", f"BLOCK={block} BLOCK_J={block_j} pdl={use_pdl}", _mhc_prenorm_reduce_kernel,
                               _REDUCE_SIGNATURE, _REDUCE_DIVISIBLE,
                               {"BLOCK": block, "BLOCK_J": block_j, "USE_PDL": use_pdl}, cfgs.REDUCE_NUM_WARPS, 3))
    return out


def compile_shipped(arch: int) -> list[Any]:
    """Compile the kernels with every configuration shipped for ``sm_<arch>`` (:func:`shipped_variants`),
    ahead of time. Returns one :class:`nsa_backend.kernels.aot.CompiledKernel` per compilation; needs
    ``TRITON_INTERPRET`` unset.
    """
    return [_compile(v.kernel, v.signature, v.aligned, v.constexprs, arch, v.num_warps, v.num_stages, v.options)
            for v in shipped_variants(arch)]
