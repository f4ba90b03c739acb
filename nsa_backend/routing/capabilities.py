"""Which implementation supports which (op, arch, shape, dtype): one declarative table.

Every row of :data:`TABLE` is a :class:`Support`: an op, an implementation, the arch families it
runs on, an optional native package with a version range, and constraints on the shape features
the public op passes to routing (``num_heads``, ``head_dim``, ``d_qk``, ``kv_format``,
``page_size``, ``next_n``, ...). A call is supported when some row matches. Constraints that can
be met by zero-padding (indexer heads with zero weights, FlashMLA query heads) say so, and routing
pads rather than giving up the native kernel.

Sources (versions checked): DeepGEMM 2.0-2.6 ``csrc/apis/attention.hpp`` and
``hyperconnection.hpp``, and for SM120 / SM121 the DeepGEMM 2.8.1 bundled with vLLM 0.33 / 0.34 and
``sgl-deep-gemm`` 0.2.3.post2 (``csrc/jit_kernels/impls/sm120_*.hpp``); FlashMLA 1.0
(``sgl-flash-mla`` 1.0.0: SM90 and the V3.2 cache format through ``use_legacy=True``); FlashInfer
0.6.18-0.7.2 ``mla/_sparse_mla_sm120``.

Whether a DeepGEMM build has SM120 kernels cannot be read from its version (forks number their own
releases, and upstream added the ``arch_major == 12`` branches in the 2.x line): the shared library
is read instead (:func:`read_deep_gemm_library`, no GPU needed). It names every JIT kernel it can
compile (``sm120_fp8_mqa_logits``, ...) and keeps its host assertions as text; rows that need a
kernel name it (``Support.kernels``), and limits a build states about itself (the SM120 paged
``block_kv``) narrow the documented ones (``Support.library_limits``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from nsa_backend._settings import settings_changed
from nsa_backend.native.versions import deep_gemm_api_version, parse_version
from nsa_backend.routing import device as _device
from nsa_backend.routing.device import CUDA_ARCHS, GPU_ARCHS

OPS: tuple[str, ...] = (
    "fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "pack_indexer_k_cache",
    "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "pack_indexer_k_cache_fp4",
    "topk_indices", "logical_to_global_indices",
    "flash_mla_sparse_fwd", "sparse_mla_decode",
    "pack_fp8_ds_mla", "unpack_fp8_ds_mla", "write_fp8_ds_mla_cache",
    "pack_fp8_ds_mla_v4", "unpack_fp8_ds_mla_v4", "write_fp8_ds_mla_v4_cache",
    "tf32_hc_prenorm_gemm",
)
NATIVE_IMPLS: tuple[str, ...] = ("deep_gemm", "flash_mla", "flashinfer")
IMPLS: tuple[str, ...] = ("reference", "triton", *NATIVE_IMPLS)
# Python module (import name) and distribution names of each native package.
NATIVE_MODULES: dict[str, str] = {"deep_gemm": "deep_gemm", "flash_mla": "flash_mla", "flashinfer": "flashinfer"}
NATIVE_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "deep_gemm": ("deep_gemm", "sgl-deep-gemm", "deep-gemm"),
    "flash_mla": ("flash_mla", "sgl-flash-mla", "flash-mla"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}


# ----------------------------------------------------------------------------------------------
# Constraints
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OneOf:
    """The feature must be one of ``values``; with ``pad=True`` a smaller integer is padded up to
    the next accepted value (zero heads that do not change the result)."""

    values: tuple[Any, ...]
    pad: bool = False

    def check(self, value: Any) -> bool:
        return value in self.values or (self.pad and self.pad_to(value) is not None)

    def pad_to(self, value: Any) -> Any:
        if value in self.values:
            return value
        if not self.pad or not isinstance(value, int):
            return None
        bigger = [v for v in self.values if v > value]
        return min(bigger) if bigger else None

    def describe(self) -> str:
        vals = "{" + ", ".join(str(v) for v in self.values) + "}"
        return f"in {vals}" + (" (smaller values are zero-padded)" if self.pad else "")


@dataclasses.dataclass(frozen=True)
class Range:
    """``lo <= feature <= hi`` (either bound optional)."""

    lo: int | None = None
    hi: int | None = None

    def check(self, value: Any) -> bool:
        if not isinstance(value, int):
            return False
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in [{self.lo}, {self.hi}]"
        return f">= {self.lo}" if self.lo is not None else f"<= {self.hi}"


@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """The feature must be a positive multiple of ``n`` (and at most ``hi`` when given)."""

    n: int
    hi: int | None = None

    def check(self, value: Any) -> bool:
        return (isinstance(value, int) and value > 0 and value % self.n == 0
                and (self.hi is None or value <= self.hi))

    def describe(self) -> str:
        return f"a multiple of {self.n}" + (f" <= {self.hi}" if self.hi is not None else "")


@dataclasses.dataclass(frozen=True)
class Flag:
    """The feature must be ``True``; ``meaning`` says what it stands for. A call that does not report the
    feature (``plan``, the frameworks' own per-call routes, whose buffers always qualify) is assumed to
    have it; the public ops report it from their tensors."""

    meaning: str

    def check(self, value: Any) -> bool:
        return value is True

    def describe(self) -> str:
        return f"True ({self.meaning})"


Constraint = OneOf | Range | MultipleOf | Flag


@dataclasses.dataclass(frozen=True)
class Support:
    """One row of the capability table."""

    op: str
    impl: str
    archs: frozenset[str]
    where: tuple[tuple[str, Constraint], ...] = ()
    package: str | None = None
    min_version: str | None = None
    max_version: str | None = None   # exclusive
    note: str = ""
    # "module:function(device) -> (ok, why)" run once per GPU: the fallback for builds whose library
    # could not be read (``NativeStatus.library is None``, e.g. a package assumed by ``plan``).
    probe: str | None = None
    # JIT kernel names the package's library must contain (read without a GPU).
    kernels: tuple[str, ...] = ()
    # (feature, library limit key): where the library states the accepted values of a feature
    # (:attr:`LibraryInfo.limits`), the feature must also be one of them.
    library_limits: tuple[tuple[str, str], ...] = ()

    def version_ok(self, version: str | None) -> bool:
        if self.min_version is None and self.max_version is None:
            return True
        if version is None:
            return self.min_version is None
        v = parse_version(version)
        if self.min_version is not None and v < parse_version(self.min_version):
            return False
        return not (self.max_version is not None and v >= parse_version(self.max_version))

    def version_text(self) -> str:
        lo, hi = self.min_version, self.max_version
        if lo and hi:
            return f"{self.package} >= {lo}, < {hi}"
        if lo:
            return f"{self.package} >= {lo}"
        if hi:
            return f"{self.package} < {hi}"
        return self.package or ""


def _row(op: str, impl: str, archs: Iterable[str], *, package: str | None = None, min_version: str | None = None,
         max_version: str | None = None, note: str = "", probe: str | None = None, kernels: tuple[str, ...] = (),
         library_limits: tuple[tuple[str, str], ...] = (), **where: Constraint) -> Support:
    return Support(op, impl, frozenset(archs), tuple(where.items()), package, min_version, max_version, note, probe,
                   kernels, library_limits)


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------

SM90 = ("sm90",)
SM100 = ("sm100", "sm103")          # DeepGEMM and FlashMLA build sm_100f (B200 and B300)
SM120 = ("sm120", "sm121")
_IDX_HEAD_DIM = OneOf((32, 64, 128))
_SM90_HEADS = OneOf((32, 64), pad=True)
_DG = {"package": "deep_gemm"}
# FlashMLA's decode reads pages with TMA, which addresses memory in 16-byte units; other page strides
# give wrong keys (H200: DeepSeek-V4 decode over pages spaced 40 bytes apart failed the GPU fuzz).
_TMA_ALIGNED = Flag("kv_cache and extra_kv_cache start at 16-byte aligned addresses with page strides "
                    "that are multiples of 16 bytes")
# DeepGEMM SM100 indexer head counts per release band [min, max): 2.2 - 2.3 (Nov 2025 - Jan 2026)
# failed to compile for H < 52, 2.4 - 2.5 assert H in {32, 64}, 2.6 adds 8 and 16.
_SM100_HEAD_BANDS: tuple[tuple[str | None, str | None, tuple[int, ...], str], ...] = (
    (None, "2.2", (32, 64), ""),
    ("2.2", "2.4", (64,), "this DeepGEMM's SM100 indexer needs H >= 52: heads padded to 64"),
    ("2.4", "2.6", (32, 64), ""),
    ("2.6", None, (8, 16, 32, 64), ""),
)


def _deep_gemm_ragged_rows() -> tuple[Support, ...]:
    rows = [_row("fp8_mqa_logits", "deep_gemm", SM90, **_DG, num_heads=_SM90_HEADS, head_dim=_IDX_HEAD_DIM)]
    for lo, hi, heads, note in _SM100_HEAD_BANDS:
        rows.append(_row("fp8_mqa_logits", "deep_gemm", SM100, **_DG, min_version=lo, max_version=hi, note=note,
                         num_heads=OneOf(heads, pad=True), head_dim=_IDX_HEAD_DIM))
    return tuple(rows)


def _deep_gemm_paged_rows() -> tuple[Support, ...]:
    """Paged logits. Before 2.2 only 1-D context_lens (2-D only with next_n == 1, squeezed by the
    wrapper); 2.2 - 2.3 take both forms with next_n <= 2 and block_kv 64; 2.4+ take 2-D only (1-D is
    expanded by the wrapper), any next_n, and block_kv 32 or 64 on SM100."""
    rows = []
    sm90_bands = ((None, "2.2", (32, 64), ""), ("2.2", "2.4", (32, 64), ""), ("2.4", None, (32, 64), ""))
    for archs, bands in ((SM90, sm90_bands), (SM100, _SM100_HEAD_BANDS)):
        for lo, hi, heads, note in bands:
            common = {"num_heads": OneOf(heads, pad=True), "head_dim": _IDX_HEAD_DIM}
            old = hi is not None and parse_version(hi) <= (2, 2)
            new = lo is not None and parse_version(lo) >= (2, 4)
            page = OneOf((32, 64)) if new and archs == SM100 else OneOf((64,))
            if old:
                rows.append(_row("fp8_paged_mqa_logits", "deep_gemm", archs, **_DG, min_version=lo, max_version=hi,
                                 note=note, **common, page_size=page, next_n=OneOf((1, 2)),
                                 context_lens_2d=OneOf((False,))))
                rows.append(_row("fp8_paged_mqa_logits", "deep_gemm", archs, **_DG, min_version=lo, max_version=hi,
                                 note=note, **common, page_size=page, next_n=OneOf((1,)),
                                 context_lens_2d=OneOf((True,))))
            else:
                rows.append(_row("fp8_paged_mqa_logits", "deep_gemm", archs, **_DG, min_version=lo, max_version=hi,
                                 note=note, **common, page_size=page,
                                 next_n=Range(1, None) if new else OneOf((1, 2))))
    return tuple(rows)


# DeepGEMM indexer over an MXFP4 key cache (``fp8_fp4_*mqa_logits``), from the host assertions of the
# DeepGEMM 2.8.1 bundled with vLLM 0.34 (``csrc/apis/attention.hpp``, ``sm100_mqa_logits.hpp``,
# ``sm120_mqa_logits.hpp``): q and K of one element type, so only MXFP4 queries (``q_fp4``); FP4 needs
# UE8M0 (MX) scales, which SM90 does not take (SM90 has no FP4 path); SM100 heads a multiple of 4
# dividing 128 (fewer heads zero-padded), head_dim 128; SM100 paged logits only in the varlen form
# (the wrapper makes it) with block_kv 32 / 64 / 128 (our cache: 32 / 64). Older releases declared
# these functions with other signatures and are not routed (``min_version``).
_FP4_MIN = "2.8"
_SM100_FP4_HEADS = OneOf((4, 8, 16, 32, 64, 128), pad=True)
_FP4_Q = OneOf((True,))


def _deep_gemm_fp4_rows() -> tuple[Support, ...]:
    return (
        _row("fp8_fp4_mqa_logits", "deep_gemm", SM100, **_DG, min_version=_FP4_MIN, num_heads=_SM100_FP4_HEADS,
             q_fp4=_FP4_Q),
        _row("fp8_fp4_paged_mqa_logits", "deep_gemm", SM100, **_DG, min_version=_FP4_MIN,
             num_heads=_SM100_FP4_HEADS, q_fp4=_FP4_Q, page_size=OneOf((32, 64)), next_n=Range(1, None)),
    )


_DG_SM120_PROBE = "nsa_backend.native.deep_gemm:arch_supported"
_DG_SM120_NOTE = "DeepGEMM SM120 kernel"
# DeepGEMM on SM120 / SM121 (one sm_120f kernel family), from the host code of the builds that have
# the kernels (``sm120_mqa_logits.hpp``, ``sm120_tf32_hc_prenorm_gemm.hpp``, ``attention.hpp``):
# indexer H in {32, 64} (fewer heads zero-padded; 16 is accepted by some builds only), head_dim 128,
# 2-D context lengths with any next_n, paged block_kv 32 or 64 as the build's ``arch_major == 12``
# assertion states (``sgl-deep-gemm`` 0.2.3 and vLLM's ``get_paged_mqa_page_sizes`` keep 64 only);
# mHC pre-norm N <= 128 with N % 8 == 0, K % 64 == 0. Each row needs its kernel in the library.
_SM120_HEADS = OneOf((32, 64), pad=True)
_SM120_PAGE = (("page_size", "sm120.paged_block_kv"),)
_DG_SM120_ROWS: tuple[tuple[str, str, dict[str, Constraint], tuple[tuple[str, str], ...]], ...] = (
    ("fp8_mqa_logits", "sm120_fp8_mqa_logits", {"num_heads": _SM120_HEADS, "head_dim": OneOf((128,))}, ()),
    ("get_paged_mqa_logits_metadata", "sm120_paged_mqa_logits_metadata", {"page_size": OneOf((32, 64))},
     _SM120_PAGE),
    ("fp8_paged_mqa_logits", "sm120_fp8_paged_mqa_logits",
     {"num_heads": _SM120_HEADS, "head_dim": OneOf((128,)), "page_size": OneOf((32, 64)), "next_n": Range(1, None)},
     _SM120_PAGE),
    ("tf32_hc_prenorm_gemm", "sm120_tf32_hc_prenorm_gemm", {"n": MultipleOf(8, hi=128), "k": MultipleOf(64)}, ()),
    # MXFP4 queries and keys (the SM120 FP4 kernels; the 2.8 API, see _deep_gemm_fp4_rows).
    ("fp8_fp4_mqa_logits", "sm120_fp4_mqa_logits", {"num_heads": _SM120_HEADS, "q_fp4": _FP4_Q}, ()),
    ("fp8_fp4_paged_mqa_logits", "sm120_fp4_paged_mqa_logits",
     {"num_heads": _SM120_HEADS, "q_fp4": _FP4_Q, "page_size": OneOf((32, 64)), "next_n": Range(1, None)}, ()),
)
_FP4_OPS = ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits")

# What a route to the Triton kernels says (the plan names the kernel where the launcher picks one per call).
TRITON_NOTE = "portable Triton kernel"
_TRITON_OPS = (
    "fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "topk_indices",
    "logical_to_global_indices", "flash_mla_sparse_fwd", "sparse_mla_decode", "pack_fp8_ds_mla",
    "write_fp8_ds_mla_cache", "tf32_hc_prenorm_gemm",
    # DeepSeek-V4 KV cache (584-byte tokens): integer-only e4m3 / UE8M0 code, one kernel for every arch.
    "pack_fp8_ds_mla_v4", "unpack_fp8_ds_mla_v4", "write_fp8_ds_mla_v4_cache",
    # Indexer over an MXFP4 key cache: e2m1 / e4m3 / UE8M0 decoded in software, fp16 MMAs, every arch.
    "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
)

TABLE: tuple[Support, ...] = (
    # Triton: every GPU the kernels compile for.
    *(_row(op, "triton", GPU_ARCHS, note=TRITON_NOTE) for op in _TRITON_OPS),
    # DeepGEMM indexer (versions are upstream DeepGEMM's API level, see deep_gemm_api_version).
    *_deep_gemm_ragged_rows(),
    _row("get_paged_mqa_logits_metadata", "deep_gemm", SM90, **_DG, page_size=OneOf((64,))),
    _row("get_paged_mqa_logits_metadata", "deep_gemm", SM100, **_DG, max_version="2.4", page_size=OneOf((64,))),
    _row("get_paged_mqa_logits_metadata", "deep_gemm", SM100, **_DG, min_version="2.4",
         page_size=OneOf((32, 64))),
    *_deep_gemm_paged_rows(),
    # DeepGEMM mHC pre-norm GEMM (added in 2.3): SM90 for N <= 32, SM100 any N; K % 64 == 0.
    _row("tf32_hc_prenorm_gemm", "deep_gemm", SM90, **_DG, min_version="2.3", n=Range(1, 32),
         k=MultipleOf(64)),
    _row("tf32_hc_prenorm_gemm", "deep_gemm", SM100, **_DG, min_version="2.3", k=MultipleOf(64)),
    # DeepGEMM on SM120 / SM121: only builds whose library has the kernel (see _DG_SM120_ROWS).
    *_deep_gemm_fp4_rows(),
    *(_row(op, "deep_gemm", SM120, **_DG, probe=_DG_SM120_PROBE, note=_DG_SM120_NOTE, kernels=(kernel,),
           library_limits=limits, min_version=_FP4_MIN if op in _FP4_OPS else None, **where)
      for op, kernel, where, limits in _DG_SM120_ROWS),
    # FlashMLA sparse prefill: h_q 64 / 128 (smaller head counts padded with zero queries),
    # d_qk 576 (V3.2 / GLM-5) or 512 (V4), d_v 512.
    _row("flash_mla_sparse_fwd", "flash_mla", (*SM90, *SM100), package="flash_mla",
         num_heads=OneOf((64, 128), pad=True), d_qk=OneOf((576, 512))),
    # FlashMLA sparse decode over the 656-byte fp8_ds_mla cache.
    _row("sparse_mla_decode", "flash_mla", (*SM90, *SM100), package="flash_mla",
         num_heads=OneOf((64, 128), pad=True), d_qk=OneOf((576,)), kv_format=OneOf(("fp8_ds_mla",)),
         page_size=OneOf((64,)), kv_cache_aligned=_TMA_ALIGNED),
    # FlashMLA DeepSeek-V4 sparse decode over the 584-byte fp8_ds_mla_v4 cache (with the extra key list):
    # d_qk 512, h_q 64 / 128 (fewer heads padded, as vLLM's DeepseekV4 FlashMLA attention pads them),
    # the format's page sizes 64 and 256.
    _row("sparse_mla_decode", "flash_mla", (*SM90, *SM100), package="flash_mla",
         num_heads=OneOf((64, 128), pad=True), d_qk=OneOf((512,)), kv_format=OneOf(("fp8_ds_mla_v4",)),
         page_size=OneOf((64, 256)), kv_cache_aligned=_TMA_ALIGNED),
    # FlashInfer sparse MLA decode for SM120 / SM121 (trtllm_batch_decode_with_kv_cache_mla with
    # sparse_mla_top_k): page 64, its (heads, topk) buckets, decode-sized calls only.
    _row("sparse_mla_decode", "flashinfer", SM120, package="flashinfer", min_version="0.6.18",
         num_heads=OneOf((8, 16, 32, 64, 128), pad=True), d_qk=OneOf((576,)), kv_format=OneOf(("fp8_ds_mla",)),
         page_size=OneOf((64,)), topk=OneOf((128, 512, 1024, 2048)), s_q=Range(1, 64)),
)

# Calls for which the Triton route is measured faster than a native kernel that runs them only on
# zero-padded heads: "auto" then takes Triton. H200 (sm_90), bench/results/h200/results.md (ee1dddf,
# decode at 32 heads df14276), against FlashMLA on heads padded to 64: the few-head Gluon prefill
# 1.43x / 1.11x at h_q 16 / 32 (s_q 4096, topk 2048); the few-head Gluon decode 1.28-1.38x at h_q 16
# (B 32 / 128, s_q 1 / 2, topk 2048); at h_q 17-32 the 64-head Gluon decode on padded heads, 1.05-1.37x
# faster than FlashMLA through this package (which pads q and copies the outputs back: 43.6 / 70.0 /
# 121.6 / 239.8 us against 59.5 / 88.0 / 134.1 / 252.9 us at B 32 / 32 / 128 / 128, s_q 1 / 2 / 1 / 2;
# a direct FlashMLA call on padded heads takes 47.6 / 73.5 / 114.0 / 220.5 us). Those kernels need
# Triton's Gluon on the device (``nsa_backend.kernels._gluon``); the ``tl`` kernels that run without it
# are slower than the padded native kernel, so the preference holds only where Gluon may run
# (:func:`gluon_usable`).
TRITON_OVER_PADDED: tuple[Support, ...] = (
    _row("flash_mla_sparse_fwd", "triton", SM90, num_heads=Range(1, 32), d_qk=OneOf((576,)),
         note="few-head Gluon prefill kernel: faster than FlashMLA on heads padded to 64"),
    _row("sparse_mla_decode", "triton", SM90, num_heads=Range(1, 32), d_qk=OneOf((576,)),
         kv_format=OneOf(("fp8_ds_mla",)), page_size=OneOf((64,)),
         note="Gluon decode kernels (few-head up to 16 heads, 64-head on padded heads above): faster than "
              "FlashMLA on heads padded to 64"),
)


def gluon_usable(arch: str) -> bool:
    """Whether the Gluon kernels may run on ``arch`` (``"sm90"``, ...): this Triton has a Gluon they are
    written for and ``NSA_BACKEND_GLUON`` does not turn them off."""
    # Imported here: the kernels import Triton, which routing does not need otherwise.
    from nsa_backend.kernels._gluon import gluon_enabled

    digits = arch[2:] if arch.startswith("sm") else ""
    return digits.isdigit() and gluon_enabled(int(digits), (int(digits),))


def triton_over_padded(op: str, arch: str, features: Mapping[str, Any]) -> str | None:
    """Why ``auto`` should take Triton for this call rather than a native kernel on padded heads (a row
    of :data:`TRITON_OVER_PADDED` matches and Gluon may run), or ``None``."""
    for row in TRITON_OVER_PADDED:
        if row.op == op and arch in row.archs and _check_row(row, features)[0] is None and gluon_usable(arch):
            return row.note
    return None


# Features that can change a decision, per op (the routing cache key).
SHAPE_FEATURES: dict[str, tuple[str, ...]] = {
    op: tuple(sorted({name for row in TABLE if row.op == op for name, _ in row.where})) for op in OPS
}


@functools.cache
def rows(op: str, impl: str) -> tuple[Support, ...]:
    """Table rows for ``(op, impl)``."""
    return tuple(row for row in TABLE if row.op == op and row.impl == impl)


def impls_with_rows(op: str) -> tuple[str, ...]:
    """Implementations the table lists for ``op`` (reference is implicit)."""
    return tuple(dict.fromkeys(row.impl for row in TABLE if row.op == op))


# ----------------------------------------------------------------------------------------------
# Native package probe
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LibraryInfo:
    """What a native package's shared library says about itself (read from the file, no GPU).

    ``kernels``: the JIT kernel names it can compile (``sm120_fp8_mqa_logits``, ...). ``limits``: values
    a feature may take as stated by the library's own host assertions, e.g. ``"sm120.paged_block_kv"``
    -> ``(32, 64)``; a key is absent where the library does not state it.
    """

    path: str
    kernels: frozenset[str]
    limits: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        archs = sorted({k.split("_", 1)[0] for k in self.kernels}, key=lambda a: int(a[2:]) if a[2:].isdigit() else 0)
        limits = ", ".join(f"{key} {set(vals)}" for key, vals in self.limits.items())
        return f"{os.path.basename(self.path)}: kernels for {', '.join(archs) or 'no arch'}" + (
            f"; {limits}" if limits else "")


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """Whether a native package imports, its version, and why not."""

    name: str
    available: bool
    version: str | None = None
    error: str | None = None
    api_version: str | None = None   # upstream release whose API the module matches (DeepGEMM forks)
    library: LibraryInfo | None = None   # None: not read (not found, or a package assumed by ``plan``)

    @property
    def effective_version(self) -> str | None:
        return self.api_version or self.version


def _distribution_version(name: str) -> str | None:
    for dist in NATIVE_DISTRIBUTIONS[name]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# A JIT kernel name stored as its own C string in the library (``jit->compile("sm120_...", ...)``).
_KERNEL_NAME = re.compile(rb"(?<=\x00)(sm\d{2,3}[a-z]?_[a-z0-9_]+)(?=\x00)")
# The paged-logits assertion on the fused KV cache names each arch's block_kv; its SM120 clause is
# ``arch_major == 12 and block_kv == 64`` or ``arch_major == 12 and (block_kv == 32 or block_kv == 64)``
# (a build that also takes FP4 pages writes ``(not is_fp4 and block_kv == 64)`` for the FP8 ones).
_SM120_CLAUSE = b"arch_major == 12 and "
_BLOCK_KV_VALUE = re.compile(r"block_kv == (\d+)")


def _clause_after(text: str) -> str:
    """The operand at the start of ``text``: a balanced ``( ... )`` group, or up to the first ``)``."""
    if not text.startswith("("):
        return text.split(")", 1)[0]
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[:i + 1]
    return text


def _sm120_paged_block_kv(data: bytes) -> tuple[int, ...] | None:
    at = data.find(_SM120_CLAUSE)
    while at >= 0:
        stop = data.find(b"\x00", at)
        text = data[at + len(_SM120_CLAUSE):stop].decode("ascii", "replace")
        clause = _clause_after(text)
        if "block_kv" in clause:
            fp8 = _clause_after(clause.split("not is_fp4 and ", 1)[1]) if "not is_fp4 and " in clause else clause
            values = tuple(sorted({int(v) for v in _BLOCK_KV_VALUE.findall(fp8)}))
            if values:
                return values
        at = data.find(_SM120_CLAUSE, at + 1)
    return None


def _library_file(package_dir: str) -> str | None:
    """The compiled extension of a DeepGEMM package (``_C.so``, ``_C.cpython-*.so``, ``_C_extension.abi3.so``)."""
    try:
        names = sorted(os.listdir(package_dir))
    except OSError:
        return None
    for name in names:
        if name.startswith("_C") and name.endswith(".so"):
            return os.path.join(package_dir, name)
    return None


@functools.cache
def _read_library(path: str, mtime: float) -> LibraryInfo:
    with open(path, "rb") as f:
        data = f.read()
    kernels = frozenset(m.decode() for m in _KERNEL_NAME.findall(data))
    limits: dict[str, tuple[int, ...]] = {}
    block_kv = _sm120_paged_block_kv(data)
    if block_kv is not None:
        limits["sm120.paged_block_kv"] = block_kv
    return LibraryInfo(path, kernels, limits)


def read_deep_gemm_library(package_dir: str) -> LibraryInfo | None:
    """Read the shared library of the DeepGEMM package in ``package_dir`` without importing it or
    touching a GPU: its JIT kernel names and the limits it states (see :class:`LibraryInfo`).

    Returns ``None`` when the directory holds no ``_C*.so``. Cached per file and modification time.
    """
    path = _library_file(package_dir)
    if path is None:
        return None
    return _read_library(path, os.path.getmtime(path))


def package_version_in(package_dir: str) -> str | None:
    """Version a package directory declares without importing it: a ``VERSION`` file
    (``sgl-deep-gemm``) or a literal ``__version__ = "..."`` in ``__init__.py`` (vendored copies)."""
    try:
        with open(os.path.join(package_dir, "VERSION")) as f:
            return f.read().strip() or None
    except OSError:
        pass
    try:
        with open(os.path.join(package_dir, "__init__.py")) as f:
            match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
    except OSError:
        return None
    return match.group(1) if match else None


def _probe_one(name: str) -> NativeStatus:
    module_name = NATIVE_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a broken binary raises OSError/RuntimeError, not only ImportError
        return NativeStatus(name, False, _distribution_version(name), f"{type(exc).__name__}: {exc}")
    version = getattr(module, "__version__", None) or _distribution_version(name)
    version = str(version) if version is not None else None
    api = deep_gemm_api_version(module) if name == "deep_gemm" else None
    library = None
    if name == "deep_gemm" and getattr(module, "__file__", None):
        library = read_deep_gemm_library(os.path.dirname(os.path.abspath(module.__file__)))
    return NativeStatus(name, True, version, api_version=api if api != version else None, library=library)


_probe_override: dict[str, NativeStatus] | None = None


@functools.cache
def _probe_all() -> dict[str, NativeStatus]:
    return {name: _probe_one(name) for name in NATIVE_IMPLS}


def probe_natives() -> dict[str, NativeStatus]:
    """Import every native package once and report availability and version."""
    if _probe_override is not None:
        return _probe_override
    return _probe_all()


def set_native_status(statuses: Mapping[str, NativeStatus] | None) -> None:
    """Replace the probe result (``None`` restores the real probe); for tests and ``plan``."""
    global _probe_override
    if statuses is None:
        _probe_override = None
    else:
        full = {name: NativeStatus(name, False, None, "not installed") for name in NATIVE_IMPLS}
        full.update(statuses)
        _probe_override = full
    settings_changed()


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of checking one implementation for one call."""

    ok: bool
    reason: str = ""
    padded: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    row: Support | None = None


def _check_row(row: Support, features: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    padded: dict[str, Any] = {}
    for name, constraint in row.where:
        if name not in features or features[name] is None:
            if isinstance(constraint, Flag):
                continue
            return f"{name} unknown (the call did not report it)", padded
        value = features[name]
        if not constraint.check(value):
            return f"{name}={value!r} is not {constraint.describe()}", padded
        if isinstance(constraint, OneOf) and constraint.pad and value not in constraint.values:
            padded[name] = constraint.pad_to(value)
    return None, padded


def evaluate(op: str, impl: str, arch: str, features: Mapping[str, Any],
             natives: Mapping[str, NativeStatus] | None = None) -> Verdict:
    """Can ``impl`` run ``op`` on ``arch`` for these shape features? The reason says why not."""
    if impl == "reference":
        return Verdict(True, "plain PyTorch, runs anywhere")
    candidates = rows(op, impl)
    if not candidates:
        return Verdict(False, f"{impl} has no {op} kernel")
    on_arch = [row for row in candidates if arch in row.archs]
    if not on_arch:
        archs = sorted({a for row in candidates for a in row.archs})
        return Verdict(False, f"{impl} has no {op} kernel for {arch} (it has kernels for {', '.join(archs)})")
    package = on_arch[0].package
    status = None
    if package is not None:
        status = (natives if natives is not None else probe_natives()).get(package)
        if status is None or not status.available:
            why = status.error if status is not None and status.error else "not installed"
            return Verdict(False, f"package {package} is not importable ({why})")
        on_arch = [row for row in on_arch if row.version_ok(status.effective_version)]
        if not on_arch:
            ranges = "; ".join(row.version_text() for row in rows(op, impl) if arch in row.archs)
            return Verdict(False, f"installed {package} {status.effective_version} has no {op} kernel for {arch} "
                                  f"(supported: {ranges})")
    reasons = []
    for row in on_arch:
        reason, padded = _check_row(row, features)
        note = row.note
        if reason is None and row.kernels:
            reason, note = _kernel_reason(row, status, arch, features)
        elif reason is None and row.probe is not None:
            reason = _probe_reason(row, arch, features.get("device"))
        if reason is None:
            return Verdict(True, note, padded, row)
        if reason not in reasons:
            reasons.append(reason)
    return Verdict(False, f"{impl} {op} on {arch}: " + "; or ".join(reasons))


# Release from which DeepGEMM builds carry the SM120 kernels (vLLM 0.33 / 0.34 bundle 2.8.1 with them).
# Used only when no library could be read: a package assumed by ``nsa-backend plan --assume-natives``.
KERNELS_ASSUMED_FROM: dict[str, str] = {"deep_gemm": "2.8"}


def _kernel_reason(row: Support, status: NativeStatus | None, arch: str,
                   features: Mapping[str, Any]) -> tuple[str | None, str]:
    """``(None, note)`` when the package's library has ``row.kernels`` and states no limit the call
    breaks, else ``(why not, "")``. Without a library: the GPU probe on a GPU, else the version."""
    library = status.library if status is not None else None
    if library is None:
        device = features.get("device")
        if row.probe is not None and device is not None and _device_type(device) == "cuda":
            reason = _probe_reason(row, arch, device)
            return reason, ("" if reason else f"{row.note} (checked on this GPU)")
        first = KERNELS_ASSUMED_FROM.get(row.package or "")
        version = status.effective_version if status is not None else None
        if first is not None and version is not None and parse_version(version) >= parse_version(first):
            return None, (f"{row.note} {', '.join(row.kernels)} (assumed: {row.package} >= {first} builds have it; "
                          f"no library read)")
        return (f"whether {row.package} {version or ''} has {', '.join(row.kernels)} is unknown: its library "
                f"was not read (builds from {first} have it)" if first else
                f"whether {row.package} has {', '.join(row.kernels)} is unknown"), ""
    missing = [k for k in row.kernels if k not in library.kernels]
    if missing:
        return (f"the installed {row.package} {status.version if status else ''} library has no "
                f"{', '.join(missing)} kernel ({library.describe()})"), ""
    for name, key in row.library_limits:
        allowed = library.limits.get(key)
        if allowed is not None and features.get(name) not in allowed:
            values = "{" + ", ".join(str(v) for v in allowed) + "}"
            return (f"{name}={features.get(name)!r} is not in {values}, which the installed {row.package} "
                    f"library states for {arch} ({os.path.basename(library.path)})"), ""
    return None, f"{row.note} {', '.join(row.kernels)} (in {os.path.basename(library.path)})"


def _device_type(device: Any) -> str:
    """``"cuda"``, ``"cpu"``, ... of a ``torch.device`` or device string."""
    import torch

    return torch.device(device).type


_probe_cache: dict[tuple[str, int], tuple[bool, str]] = {}


def _probe_reason(row: Support, arch: str, device: Any) -> str | None:
    """``None`` when the row's GPU probe passes on ``device``, else why not."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return f"whether the installed {row.package} build has {arch} kernels is only known on the GPU"
    device = torch.device(device)
    if _device.hardware_arch(device) != arch:
        return f"whether the installed {row.package} build has {arch} kernels can only be checked on an {arch} GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (row.probe, index)
    if key not in _probe_cache:
        module, func = row.probe.split(":")
        try:
            _probe_cache[key] = getattr(importlib.import_module(module), func)(torch.device("cuda", index))
        except Exception as exc:
            _probe_cache[key] = (False, f"{type(exc).__name__}: {exc}")
    ok, why = _probe_cache[key]
    return None if ok else f"the installed {row.package} build has no {arch} kernels ({why})"


def describe_rows(op: str | None = None, table: tuple[Support, ...] = TABLE) -> list[dict[str, str]]:
    """``table`` (the capability table, or :data:`TRITON_OVER_PADDED`) as printable rows (for
    ``nsa-backend doctor`` and the docs)."""
    out = []
    for row in table:
        if op is not None and row.op != op:
            continue
        out.append({
            "op": row.op,
            "impl": row.impl,
            "archs": ", ".join(a for a in (*sorted(CUDA_ARCHS), "rocm") if a in row.archs),
            "package": row.version_text(),
            "shape": "; ".join(f"{name} {c.describe()}" for name, c in row.where),
            "note": row.note,
        })
    return out
