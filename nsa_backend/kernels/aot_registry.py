"""Every portable ``tl`` kernel with the launch configurations the launchers use on each arch.

One :class:`AotJob` describes one compilation: the kernel, its Triton signature and ``constexpr``
values as the launcher specialises them, launch options, and the arguments the runtime sees as
multiples of 16 (aligned pointers, strides). :func:`shipped_jobs` lists them per architecture and
family; the ahead-of-time tests and ``python -m nsa_backend.kernels.aot_report`` (the committed
registers / spills / shared-memory table) both compile from here.

The mHC, indexer and sparse MLA families also list their Gluon kernels for the mma.sync archs
(``mhc/sm80_gluon.py``, ``indexer/sm89_gluon_paged.py``, ``sparse_mla_prefill/sm80_gluon.py``,
``sparse_mla_decode/sm89_gluon.py``) where this Triton has Gluon. The sm_90-only Gluon kernels
(``sm90_gluon*.py``) are not listed: they have no path on other archs and their own sm_90 compile checks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nsa_backend.configs import indexer as cfg_indexer
from nsa_backend.configs import sparse_mla as cfg_sparse_mla
from nsa_backend.configs import topk as cfg_topk
from nsa_backend.kernels import mhc, slots
from nsa_backend.kernels._gluon import gluon_importable
from nsa_backend.kernels.aot import FP8_NATIVE_MIN_ARCH, CompiledKernel, compile_for_arch, compile_source
from nsa_backend.kernels.fp8_ds_mla import v4 as fp8_ds_mla_v4
from nsa_backend.kernels.fp8_ds_mla import v32 as fp8_ds_mla
from nsa_backend.kernels.indexer import fp4 as indexer_fp4
from nsa_backend.kernels.indexer import portable as indexer
from nsa_backend.kernels.indexer import sm89_gluon_paged as mma_v2_paged
from nsa_backend.kernels.sparse_mla_decode import merge as decode_merge
from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as mma_v2_decode
from nsa_backend.kernels.sparse_mla_decode import v4 as sparse_mla_v4_decode
from nsa_backend.kernels.sparse_mla_prefill import portable as sparse_mla_prefill
from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as mma_v2_prefill
from nsa_backend.kernels.topk import portable as topk

T = TypeVar("T")


@dataclass(frozen=True)
class AotJob:
    """One kernel x one launch configuration x one architecture, as the launcher compiles it.

    Attributes
    ----------
    family : str
        Op family (``"indexer"``, ``"topk"``, ``"sparse_mla"``, ...).
    kind : str
        Short kernel name within the family (``"paged"``, ``"decode"``, ...).
    config : str
        The launch configuration, readable (a config object's ``repr`` or the constexprs that vary).
    arch : int
        Compute capability.
    kernel : Any
        The ``@triton.jit`` kernel (possibly wrapped by ``@triton.heuristics``).
    signature, constexprs : dict
        Triton types of every parameter and values of the ``constexpr`` ones.
    num_warps, num_stages : int
        Launch options.
    aligned : tuple of str
        Parameters specialised as divisible by 16 at run time.
    options : dict
        Further compile options the launcher passes (``maxnreg``, ``enable_fp_fusion``).
    """

    family: str
    kind: str
    config: str
    arch: int
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    aligned: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def compile(self) -> CompiledKernel:
        """Compile for :attr:`arch` (needs ``TRITON_INTERPRET`` unset) and report the resources."""
        return compile_for_arch(self.kernel, self.signature, self.constexprs, self.arch, self.num_warps,
                                self.num_stages, aligned=self.aligned, options=self.options)

    def cubin(self) -> bytes:
        """The cubin a launch on :attr:`arch` would load (needs ``TRITON_INTERPRET`` unset)."""
        compiled, _, _ = compile_source(self.kernel, self.signature, self.constexprs, self.arch, self.num_warps,
                                        self.num_stages, aligned=self.aligned, options=self.options)
        return compiled.asm["cubin"]


def _reg_cap(max_regs: int | None) -> dict[str, Any]:
    # launchers pass a register cap per thread only where the configuration sets one
    return {"maxnreg": max_regs} if max_regs else {}


def _constexpr(signature: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    return {**signature, **{k: "constexpr" for k in constexprs}}


# ------------------------------------------------------------------------------------------------
# Indexer logits
# ------------------------------------------------------------------------------------------------

_INDEXER_RAGGED_ALIGNED = ("q_ptr", "k_ptr", "k_scale_ptr", "w_ptr", "ks_ptr", "ke_ptr", "out_ptr", "stride_out")
_INDEXER_PAGED_ALIGNED = ("q_ptr", "kv_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "out_ptr", "stride_bt", "stride_page",
                          "stride_out")


def indexer_jobs(arch: int, largest_only: bool = False) -> list[AotJob]:
    """Ragged and paged logits with every shipped configuration, and the paged schedule kernel.

    ``largest_only`` keeps, of each logits kernel, the configuration with the largest shared-memory
    estimate (a quick check of the budget).
    """
    native = arch >= FP8_NATIVE_MIN_ARCH
    ft = "*fp8e4nv" if native else "*u8"
    ragged = cfg_indexer.shipped_ragged_configs(arch)
    paged = cfg_indexer.shipped_paged_configs(arch)
    if largest_only:
        ragged = [max(ragged, key=lambda it: it[2].shared_bytes_estimate(it[1], native))]
        paged = [max(paged, key=lambda it: it[3].shared_bytes_estimate(it[2], native))]
    jobs = []
    for hp, d, cfg in ragged:
        sig = dict(q_ptr=ft, k_ptr=ft, k_scale_ptr="*fp32", w_ptr="*fp32", ks_ptr="*i32", ke_ptr="*i32",
                   out_ptr="*fp32", S="i32", N="i32", H="i32", stride_out="i32", max_seqlen_k="i32", w_scale="fp32")
        cx = dict(D=d, HP=hp, BQ=max(1, cfg.cols // hp), BLOCK_N=cfg.block_n, CLEAN=True, COMPRESSED=False,
                  FP8_NATIVE=native)
        jobs.append(AotJob("indexer", "ragged", f"HP={hp} D={d} {cfg}", arch, indexer._indexer_ragged_logits_kernel,
                           _constexpr(sig, cx), cx, cfg.num_warps, cfg.num_stages, _INDEXER_RAGGED_ALIGNED,
                           _reg_cap(cfg.max_regs)))
    for hp, _next_n, d, cfg in paged:
        sig = dict(q_ptr=ft, kv_ptr="*u8", w_ptr="*fp32", ctx_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32", H="i32",
                   max_ctx="i32", num_pages="i32", max_blocks="i32", stride_bt="i32", stride_page="i32",
                   stride_out="i32", w_scale="fp32", NEXT_N="i32", CHUNK="i32")
        cx = dict(NP=max(1, cfg.cols // hp), D=d, HP=hp, PAGE=64, BLOCK_N=cfg.block_n, CTX_2D=True,
                  FP8_NATIVE=native, SCALE_ALIGNED=True, SC_AHEAD=cfg.scale_ahead, ROW_LOOP=cfg.row_loop,
                  PG_AHEAD=cfg.scale_ahead and cfg.page_ahead and cfg.block_n == 64, K_MASK=cfg.k_mask,
                  HEAD_SLICES=cfg.head_slices)
        jobs.append(AotJob("indexer", "paged", f"HP={hp} next_n={_next_n} D={d} {cfg}", arch,
                           indexer._indexer_paged_logits_kernel, _constexpr(sig, cx), cx, cfg.num_warps,
                           cfg.num_stages, _INDEXER_PAGED_ALIGNED, _reg_cap(cfg.max_regs)))
    if arch in cfg_indexer.PAGED_MMA_V2_ARCHS and gluon_importable() and not largest_only:
        sig = dict(q_ptr="*fp8e4nv", kv_ptr="*u8", w_ptr="*fp32", ctx_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32",
                   H="i32", max_ctx="i32", num_pages="i32", max_blocks="i32", stride_bt="i32", stride_page="i32",
                   stride_out="i32", next_n="i32", groups="i32", chunk="i32")
        # one build per rows per program (two where next_n > 1) and padded head count
        builds = {(min(next_n, 2), cfg_indexer.padded_heads(h)) for next_n, heads in
                  cfg_indexer.PAGED_MMA_V2_HEADS.items() for h in heads}
        for rows, hp in sorted(builds):
            for ctx_2d in (False, True):
                # these archs multiply in e4m3 (sm89_gluon_paged.e4m3_products)
                cx = dict(NP=rows, D=mma_v2_paged.HEAD_DIM, HP=hp, PAGE=mma_v2_paged.PAGE,
                          STAGES=cfg_indexer.PAGED_MMA_V2.num_stages, CTX_2D=ctx_2d, E4M3=True,
                          NUM_WARPS=mma_v2_paged.NUM_WARPS)
                name = f"HP={hp} rows={rows} D=128 ctx_2d={ctx_2d} mma_v2"
                jobs.append(AotJob("indexer", "paged_gluon", name, arch, mma_v2_paged.kernel(),
                                   _constexpr(sig, cx), cx, mma_v2_paged.NUM_WARPS, 1, _INDEXER_PAGED_ALIGNED))
    sig = dict(ctx_ptr="*i32", out_ptr="*i32", B="i32", ctx_stride="i32", ctx_offset="i32", num_sms="i32")
    cx = dict(SPLIT=256, BLOCK_B=1024, BLOCK_SM=16)
    jobs.append(AotJob("indexer", "schedule", "BLOCK_B=1024", arch, indexer._indexer_paged_schedule_kernel,
                       _constexpr(sig, cx), cx, 4, 1, ("ctx_ptr", "out_ptr")))
    return jobs


# ------------------------------------------------------------------------------------------------
# Top-k and slot helpers
# ------------------------------------------------------------------------------------------------

def topk_jobs(arch: int) -> list[AotJob]:
    """Every top-k kernel with every shipped configuration (rows with starts and ends)."""
    common = dict(N="i32", K="i32", stride_x="i32")
    flags = dict(HAS_STARTS=True, HAS_ENDS=True)
    jobs = []

    def add(kind: str, config: str, kernel: Any, sig: dict[str, str], cx: dict[str, Any], num_warps: int,
            aligned: tuple[str, ...], max_regs: int = 0) -> None:
        jobs.append(AotJob("topk", kind, config, arch, kernel, _constexpr(sig, cx), cx, num_warps, 1, aligned,
                           _reg_cap(max_regs)))

    for cfg in cfg_topk.shipped_configs():
        add("histogram", str(cfg), topk._topk_histogram_kernel,
            dict(x_ptr="*fp32", hist_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32", **common, SPLIT="i32"),
            dict(BLOCK=cfg.block, LEVEL=1, **flags), cfg.num_warps, ("x_ptr", "hist_ptr", "stride_x"))
        add("filter", str(cfg), topk._topk_filter_kernel,
            dict(x_ptr="*fp32", hist_ptr="*i32", count_ptr="*i32", cand_ptr="*i32", out_ptr="*i32",
                 starts_ptr="*i32", ends_ptr="*i32", **common, SPLIT="i32", CAP="i32"),
            dict(BLOCK=cfg.block, **flags), cfg.num_warps, ("x_ptr", "hist_ptr", "cand_ptr", "out_ptr", "stride_x"))
    add("finish", f"BLOCK={cfg_topk.FINISH_BLOCK}", topk._topk_finish_kernel,
        dict(x_ptr="*fp32", hist_ptr="*i32", cand_ptr="*i32", out_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32",
             **common, CAP="i32"),
        dict(BLOCK=cfg_topk.FINISH_BLOCK, **flags), cfg_topk.FINISH_NUM_WARPS,
        ("x_ptr", "hist_ptr", "cand_ptr", "out_ptr", "stride_x"))
    row_io = dict(x_ptr="*fp32", out_ptr="*i32", scratch_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32", R="i32",
                  **common)
    row_aligned = ("x_ptr", "out_ptr", "scratch_ptr", "stride_x")
    for cfg in cfg_topk.shipped_row_configs():
        cap = cfg_topk.row_capacity(cfg_topk.ROW_MAX_TOPK, cfg)
        add("row", str(cfg), topk._topk_row_kernel, row_io,
            dict(BLOCK=cfg.block, CAP=cap, SAMPLE=cfg_topk.row_sample(cap), SIGMAS=cfg_topk.ROW_SIGMAS,
                 PREFETCH=cfg.prefetch, **flags), cfg.num_warps, row_aligned)
    for cfg in cfg_topk.shipped_sieve_configs():
        cap, sample, direct = cfg_topk.sieve_sizes(cfg_topk.ROW_MAX_TOPK, cfg)
        if cfg.split == 1:
            add("sieve", str(cfg), topk._topk_sieve_kernel, row_io,
                dict(BLOCK=cfg.block, LIST_BLOCK=cfg.list_block or cfg.block, CAP=cap, SAMPLE=sample, DIRECT=direct,
                     SIGMAS=cfg_topk.ROW_SIGMAS, **flags), cfg.num_warps, row_aligned, cfg.max_regs)
            continue
        add("sieve-part", str(cfg), topk._topk_sieve_part_kernel,
            dict(x_ptr="*fp32", scratch_ptr="*i32", state_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32", **common),
            dict(BLOCK=cfg.block, CAP=cap, SAMPLE=sample, DIRECT=direct, SIGMAS=cfg_topk.ROW_SIGMAS, **flags),
            cfg.num_warps, ("x_ptr", "scratch_ptr", "stride_x"))
        add("sieve-merge", str(cfg), topk._topk_sieve_merge_kernel,
            dict(x_ptr="*fp32", out_ptr="*i32", scratch_ptr="*i32", state_ptr="*i32", starts_ptr="*i32",
                 ends_ptr="*i32", **common),
            dict(BLOCK=cfg.merge_block, CAP=cap, **flags), cfg.merge_warps, row_aligned)
    for max_n, cfg in cfg_topk.shipped_resident_configs():
        cap, fin = cfg_topk.resident_sizes(max_n, cfg_topk.ROW_MAX_TOPK, cfg)
        add("resident", f"max_n={max_n} {cfg}", topk._topk_resident_kernel, row_io,
            dict(CAP=cap, FIN=fin, EMIT_BLOCK=cfg.emit_block, **flags), cfg.num_warps, row_aligned)
    add("logical_to_global", f"BLOCK={cfg_topk.L2G_BLOCK}", topk._topk_logical_to_global_kernel,
        dict(idx_ptr="*i32", bt_ptr="*i32", req_ptr="*i32", out_ptr="*i32", K="i32", B="i32", M="i32",
             stride_bt="i32", page_size="i32"),
        dict(BLOCK=cfg_topk.L2G_BLOCK), cfg_topk.L2G_NUM_WARPS, ("idx_ptr", "out_ptr"))
    return jobs


def slots_jobs(arch: int) -> list[AotJob]:
    """The invalid-slot mask, with and without per-request lengths."""
    sig = dict(idx_ptr="*i32", len_ptr="*i32", out_ptr="*i32", num_slots="i32", topk="i32", width="i32",
               rows_per_request="i32", stride_idx_row="i32")
    jobs = []
    for has_len in (False, True):
        cx = dict(HAS_LEN=has_len, BLOCK=slots.BLOCK)
        jobs.append(AotJob("slots", "mask_invalid_slots", f"len={has_len}", arch, slots._mask_invalid_slots_kernel,
                           _constexpr(sig, cx), cx, 4, 1, ("idx_ptr", "out_ptr")))
    return jobs


# ------------------------------------------------------------------------------------------------
# KV-cache packing
# ------------------------------------------------------------------------------------------------

def fp8_ds_mla_jobs(arch: int) -> list[AotJob]:
    """The 656-byte ``fp8_ds_mla`` pack / cache write, both scale formats."""
    sig = {"kv_ptr": "*bf16", "out_ptr": "*u8", "slot_ptr": "*i64", "n_slots": "i32", "page_size": "i32",
           "stride_kv": "i32", "stride_page": "i32"}
    jobs = []
    for pow2 in (False, True):
        cx = {"POW2": pow2, "HAS_SLOTS": True}
        jobs.append(AotJob("fp8_ds_mla", "pack", f"POW2={pow2}", arch, fp8_ds_mla._fp8_ds_mla_pack_kernel,
                           _constexpr(sig, cx), cx, fp8_ds_mla.PACK_NUM_WARPS, 1))
    return jobs


def fp8_ds_mla_v4_jobs(arch: int) -> list[AotJob]:
    """The DeepSeek-V4 cache write (all options on, all off) and unpack."""
    write_sig = {"kv_ptr": "*bf16", "out_ptr": "*u8", "slot_ptr": "*i64", "w_ptr": "*bf16", "pos_ptr": "*i64",
                 "cs_ptr": "*fp32", "n_slots": "i32", "page_size": "i32", "stride_kv": "i32", "stride_page": "i32",
                 "stride_cs": "i32", "n_pos": "i32", "eps": "fp32"}
    jobs = []
    for flags in ((True, True, True), (False, False, False)):
        cx = dict(zip(("HAS_SLOTS", "HAS_NORM", "HAS_ROPE"), flags))
        # The launcher turns fused multiply-add off (separate roundings, as in the reference).
        jobs.append(AotJob("fp8_ds_mla_v4", "write", " ".join(f"{k}={v}" for k, v in cx.items()), arch,
                           fp8_ds_mla_v4._fp8_ds_mla_v4_write_kernel, _constexpr(write_sig, cx), cx,
                           fp8_ds_mla_v4.V4_NUM_WARPS, 1, options={"enable_fp_fusion": False}))
    unpack_sig = {"cache_ptr": "*u8", "out_ptr": "*bf16", "page_size": "i32", "stride_page": "i32"}
    jobs.append(AotJob("fp8_ds_mla_v4", "unpack", "-", arch, fp8_ds_mla_v4._fp8_ds_mla_v4_unpack_kernel, unpack_sig,
                       {}, fp8_ds_mla_v4.V4_NUM_WARPS, 1))
    return jobs


# ------------------------------------------------------------------------------------------------
# Sparse MLA
# ------------------------------------------------------------------------------------------------

# Runtime launches specialise pointers and these strides as multiples of 16 (vectorised and
# asynchronous copies, hence more shared memory): compile with the same attributes.
_SPARSE_MLA_DIV16 = ("q_ptr kv_ptr idx_ptr sink_ptr topk_len_ptr out_ptr lse_ptr max_ptr stride_q_row stride_q_head "
                     "stride_page stride_row stride_ob stride_or stride_os stride_oh part_o_ptr part_lse_ptr").split()


def _div16(sig: dict[str, str]) -> tuple[str, ...]:
    return tuple(n for n in _SPARSE_MLA_DIV16 if n in sig and sig[n] != "constexpr")


def sparse_mla_jobs(arch: int) -> list[AotJob]:
    """Prefill and split-K decode (bf16 and ``fp8_ds_mla`` keys) with every shipped configuration, and
    the decode merge with every ``BLOCK_D``."""
    native = arch >= FP8_NATIVE_MIN_ARCH
    jobs = []
    for kind, c, fp8 in cfg_sparse_mla.shipped_configs(arch):
        split = kind == "decode"
        sig = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
               "topk_len_ptr": "*i32", "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32",
               "max_ptr": "*fp32", "qk_scale": "fp32"}
        for n in ("h_q topk n_slots page_size keys_per_split rows_per_batch stride_q_row stride_q_head "
                  "stride_idx_row stride_page stride_row stride_ob stride_or stride_os stride_oh stride_lb "
                  "stride_lr stride_ls stride_lh").split():
            sig[n] = "i32"
        # fp8 decode also with the power-of-two dequantisation where the launcher takes it (kv_scale_format="pow2")
        pow2_choices = (False, True) if fp8 and split and cfg_sparse_mla.pow2_dequant("pow2", native) else (False,)
        for pow2 in pow2_choices:
            cx = dict(D_ROPE=64, BLOCK_H=c.block_h, BLOCK_N=c.block_n, KV_FP8=fp8, FP8_NATIVE=native, SPLIT=split,
                      IDX_AHEAD=c.idx_ahead, SHARE_KEYS=c.share_keys and fp8, REREAD_KEYS=c.reread_keys and fp8,
                      HAS_SINK=True, HAS_TOPK_LEN=True, HAS_MAX=not split, POW2_SCALES=pow2)
            label = (f"{'fp8' if fp8 else 'bf16'} BLOCK_H={c.block_h} BLOCK_N={c.block_n} warps={c.num_warps} "
                     f"stages={c.num_stages} idx_ahead={c.idx_ahead}"
                     + (f" maxnreg={c.maxnreg}" if c.maxnreg else "") + (" share_keys" if cx["SHARE_KEYS"] else "")
                     + (" reread_keys" if cx["REREAD_KEYS"] else "") + (" pow2" if pow2 else ""))
            jobs.append(AotJob("sparse_mla", kind, label, arch, sparse_mla_prefill._sparse_mla_fwd_kernel,
                               _constexpr(sig, cx), cx, c.num_warps, c.num_stages, _div16(sig),
                               {"maxnreg": c.maxnreg} if c.maxnreg else {}))
    if arch in mma_v2_prefill.MMA_V2_PREFILL_ARCHS and gluon_importable():
        jobs.extend(_mma_v2_bf16_jobs(arch))
    if arch in mma_v2_decode.MMA_V2_DECODE_ARCHS and gluon_importable():
        jobs.extend(_mma_v2_decode_jobs(arch))
    merge_sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                 "lse_ptr": "*fp32", "h_q": "i32", "s_q": "i32", "num_splits": "i32"}
    for block_d in cfg_sparse_mla.MERGE_BLOCK_D_CHOICES:
        # with the grid-dependency wait where the launch has it
        cx = {"D_V": 512, "BLOCK_H": cfg_sparse_mla.MERGE_BLOCK_H, "BLOCK_D": block_d, "HAS_SINK": True,
              "WAIT_PRIMARY": arch >= decode_merge.PDL_MIN_ARCH}
        sig = _constexpr(merge_sig, cx)
        jobs.append(AotJob("sparse_mla", "merge", f"BLOCK_D={block_d}", arch,
                           decode_merge._sparse_mla_decode_merge_kernel, sig, cx, cfg_sparse_mla.MERGE_NUM_WARPS,
                           1, _div16(sig)))
    return jobs


def _mma_v2_bf16_jobs(arch: int) -> list[AotJob]:
    """The Gluon bf16 kernel of the mma.sync archs (``sparse_mla_prefill/sm80_gluon.py``): the prefill (rows,
    ``max_logits``) and the paged decode (split partials and final outputs), with a sink and ``topk_length``."""
    jobs = []
    for kind, page, split in (("prefill_mma_v2", 1, False), ("decode_bf16_mma_v2", 64, True),
                              ("decode_bf16_mma_v2", 64, False)):
        sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "topk_len_ptr": "*i32",
               "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32", "max_ptr": "*fp32", "qk_scale": "fp32"}
        for n in ("h_q topk n_slots keys_per_split rows_per_batch stride_q_row stride_q_head stride_idx_row "
                  "stride_page stride_row stride_ob stride_or stride_os stride_oh stride_lb stride_lr stride_ls "
                  "stride_lh").split():
            sig[n] = "i32"
        prefill = kind == "prefill_mma_v2"
        cx = {k: v for k, v in mma_v2_prefill.constexprs(page, split, not split, True, prefill).items()
              if k != "num_warps"}
        label = (f"bf16 BLOCK_H={mma_v2_prefill.BLOCK_H} BLOCK_N={mma_v2_prefill.BLOCK_N} "
                 f"stages={mma_v2_prefill.STAGES}" + ("" if prefill else f" split={split}") + " mma_v2")
        jobs.append(AotJob("sparse_mla", kind, label, arch, mma_v2_prefill.kernel(), _constexpr(sig, cx), cx,
                           mma_v2_prefill.NUM_WARPS, 1, _div16(sig)))
    return jobs


def _mma_v2_decode_jobs(arch: int) -> list[AotJob]:
    """The Gluon fp8 decode of the mma.sync archs (``sparse_mla_decode/sm89_gluon.py``): split partials and final
    outputs, with and without the power-of-two conversion."""
    jobs = []
    for split in (True, False):
        for pow2 in (False, True):
            sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32", "topk_len_ptr": "*i32",
                   "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}
            for n in ("h_q topk n_slots keys_per_split rows_per_batch stride_q_row stride_q_head stride_idx_row "
                      "stride_page stride_row stride_ob stride_or stride_os stride_oh stride_lb stride_lr stride_ls "
                      "stride_lh").split():
                sig[n] = "i32"
            cx = dict(PAGE=64, BLOCK_H=mma_v2_decode.BLOCK_H, BLOCK_N=mma_v2_decode.BLOCK_N,
                      STAGES=mma_v2_decode.STAGES, SPLIT=split, HAS_SINK=not split, HAS_TOPK_LEN=True,
                      POW2_SCALES=pow2, FP8_NATIVE=arch >= FP8_NATIVE_MIN_ARCH, NUM_WARPS=mma_v2_decode.NUM_WARPS)
            label = (f"fp8 BLOCK_H={mma_v2_decode.BLOCK_H} BLOCK_N={mma_v2_decode.BLOCK_N} "
                     f"stages={mma_v2_decode.STAGES} split={split}" + (" pow2" if pow2 else "") + " mma_v2")
            jobs.append(AotJob("sparse_mla", "decode_mma_v2", label, arch, mma_v2_decode.kernel(), _constexpr(sig, cx),
                               cx, mma_v2_decode.NUM_WARPS, 1, _div16(sig)))
    return jobs


def sparse_mla_v4_jobs(arch: int) -> list[AotJob]:
    """DeepSeek-V4 sparse decode with every option on (sink, lengths, the extra cache and its lengths)."""
    sig = {"q_ptr": "*bf16", "cache_ptr": "*u8", "idx_ptr": "*i32", "len_ptr": "*i32", "extra_cache_ptr": "*u8",
           "extra_idx_ptr": "*i32", "extra_len_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
           "lse_ptr": "*fp32", "sm_scale": "fp32"}
    for n in ("s_q h_q topk extra_topk page_size stride_page n_slots extra_page_size extra_stride_page "
              "extra_n_slots").split():
        sig[n] = "i32"
    mod = sparse_mla_v4_decode
    tile = cfg_sparse_mla.v4_decode_tile(arch)
    cx = dict(BLOCK_H=tile.block_h, BLOCK_K=tile.block_k, FP8_NATIVE=arch >= FP8_NATIVE_MIN_ARCH, HAS_SINK=True,
              HAS_LEN=True, HAS_EXTRA=True, HAS_EXTRA_LEN=True)
    # pages of 2 * k tokens are 16-byte multiples apart (the runtime specialises the strides)
    aligned = tuple(n for n in sig if n.endswith("_ptr") or n.endswith("stride_page"))
    return [AotJob("sparse_mla_v4", "decode", f"BLOCK_H={tile.block_h} BLOCK_K={tile.block_k} extra", arch,
                   mod._sparse_mla_v4_decode_kernel, _constexpr(sig, cx), cx, tile.num_warps, tile.num_stages,
                   aligned)]


# ------------------------------------------------------------------------------------------------
# mHC pre-norm GEMM
# ------------------------------------------------------------------------------------------------

def mhc_jobs(arch: int) -> list[AotJob]:
    """The pre-norm GEMM, split-b and reduce kernels as :func:`nsa_backend.kernels.mhc.compile_shipped`
    compiles them (:func:`nsa_backend.kernels.mhc.shipped_variants`, with their readable labels)."""
    return [AotJob("mhc", v.kind, v.label, arch, v.kernel, v.signature, v.constexprs, v.num_warps, v.num_stages,
                   v.aligned, dict(v.options or {})) for v in mhc.shipped_variants(arch)]


def indexer_fp4_jobs(arch: int) -> list[AotJob]:
    """The MXFP4-key indexer (DeepSeek-V4), ragged and paged (pages of 64 keys), with e4m3 and MXFP4 queries,
    at 16, 32, 64 and 128 padded heads."""
    ragged = {"q_ptr": "*u8", "qs_ptr": "*u8", "k_ptr": "*u8", "ks_scale_ptr": "*u8", "w_ptr": "*fp32",
              "ks_ptr": "*i32", "ke_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "H": "i32", "cols": "i32",
              "stride_out": "i32"}
    paged = {"q_ptr": "*u8", "qs_ptr": "*u8", "kv_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32",
             "bt_ptr": "*i32", "out_ptr": "*fp32", "H": "i32", "NEXT_N": "i32", "max_ctx": "i32", "num_pages": "i32",
             "max_blocks": "i32", "stride_bt": "i32", "stride_page": "i32", "stride_out": "i32"}
    jobs = []
    for hp in (16, 32, 64, 128):
        for q_fp4 in (False, True):
            warps = indexer_fp4.num_warps_for(hp)
            label = f"HP={hp} q={'mxfp4' if q_fp4 else 'e4m3'}"
            cx = dict(D=indexer_fp4.HEAD_DIM, HP=hp, BLOCK_N=indexer_fp4.BLOCK_N, TILES=indexer_fp4.tiles_for(hp),
                      Q_FP4=q_fp4, COMPRESSED=False)
            jobs.append(AotJob("indexer_fp4", "ragged", label, arch, indexer_fp4._fp4_ragged_logits_kernel,
                               _constexpr(ragged, cx), cx, warps, 3, tuple(n for n in ragged if n.endswith("_ptr"))))
            cx = dict(D=indexer_fp4.HEAD_DIM, HP=hp, PAGE=64, BLOCK_N=indexer_fp4.BLOCK_N,
                      TILES=indexer_fp4.tiles_for(hp), Q_FP4=q_fp4, CTX_2D=False)
            jobs.append(AotJob("indexer_fp4", "paged", label, arch, indexer_fp4._fp4_paged_logits_kernel,
                               _constexpr(paged, cx), cx, warps, 3, tuple(n for n in paged if n.endswith("_ptr"))))
    return jobs


FAMILIES: dict[str, Callable[[int], list[AotJob]]] = {
    "indexer": indexer_jobs,
    "indexer_fp4": indexer_fp4_jobs,
    "topk": topk_jobs,
    "slots": slots_jobs,
    "fp8_ds_mla": fp8_ds_mla_jobs,
    "fp8_ds_mla_v4": fp8_ds_mla_v4_jobs,
    "sparse_mla": sparse_mla_jobs,
    "sparse_mla_v4": sparse_mla_v4_jobs,
    "mhc": mhc_jobs,
}


def _family_names(families: Iterable[str] | None) -> list[str]:
    names = list(FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"families: unknown {unknown}, expected some of {sorted(FAMILIES)}")
    return names


def shipped_jobs(archs: Iterable[int], families: Iterable[str] | None = None) -> list[AotJob]:
    """Every :class:`AotJob` of ``families`` (default: all of :data:`FAMILIES`) on each of ``archs``.

    Raises
    ------
    ValueError
        If a family is not in :data:`FAMILIES`.
    """
    return [job for arch in archs for name in _family_names(families) for job in FAMILIES[name](arch)]


def _run_job(fn: Callable[[AotJob], T], item: tuple[int, str, int]) -> T:
    # Jobs hold kernel objects: a worker rebuilds its family's list and takes the item-th job.
    arch, family, index = item
    return fn(FAMILIES[family](arch)[index])


def map_jobs(fn: Callable[[AotJob], T], archs: Sequence[int], families: Sequence[str] | None = None,
             workers: int | None = None) -> list[T]:
    """``fn(job)`` for every job of :func:`shipped_jobs`, in that order, in ``workers`` processes (default: the
    CPU count); ``fn`` must be a module-level function (it is sent to the workers by name).

    Raises
    ------
    RuntimeError
        Under ``TRITON_INTERPRET`` (kernels would be interpreted, not compiled).
    ValueError
        If a family is not in :data:`FAMILIES`.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("ahead-of-time compiles need TRITON_INTERPRET unset (kernels are interpreted otherwise)")
    names = _family_names(families)
    items = [(arch, name, i) for arch in archs for name in names for i in range(len(FAMILIES[name](arch)))]
    with ProcessPoolExecutor(max(1, workers or os.cpu_count() or 1)) as ex:
        return list(ex.map(functools.partial(_run_job, fn), items, chunksize=1))
