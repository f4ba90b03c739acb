"""Which implementations exist for each public op, and how a call picks one.

The table is data: ``IMPLEMENTATIONS[op][impl]`` is a ``"module:function"`` path imported on
first use, so native packages and Triton are only imported when a call needs them. Every
implementation function takes the public op's parameters (without ``impl``), already validated.

``impl="auto"`` is resolved by :func:`nsa_backend.routing.select_impl` from the device, the shape
and the user's configuration; an explicit name is checked against the same capability table.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from nsa_backend.routing.router import select_impl

IMPL_NAMES: tuple[str, ...] = ("auto", "reference", "triton", "deep_gemm", "flash_mla", "flashinfer")

_REF = "nsa_backend.reference"
_IDX = "nsa_backend.kernels.indexer"
_TOPK = "nsa_backend.kernels.topk"
_PREFILL = "nsa_backend.kernels.sparse_mla_prefill"
_DECODE = "nsa_backend.kernels.sparse_mla_decode"
_DSMLA = "nsa_backend.kernels.fp8_ds_mla"
_DSMLA_V4 = "nsa_backend.kernels.fp8_ds_mla_v4"
_DECODE_V4 = "nsa_backend.kernels.sparse_mla_v4_decode"
_MHC = "nsa_backend.kernels.mhc"
_DG = "nsa_backend.native.deep_gemm"
_FMLA = "nsa_backend.native.flash_mla"
_FI = "nsa_backend.native.flashinfer"

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    # Lightning indexer
    "fp8_mqa_logits": {
        "reference": f"{_REF}:fp8_mqa_logits",
        "triton": f"{_IDX}:fp8_mqa_logits_triton",
        "deep_gemm": f"{_DG}:fp8_mqa_logits",
    },
    "get_paged_mqa_logits_metadata": {
        "reference": f"{_REF}:get_paged_mqa_logits_metadata",
        "triton": f"{_IDX}:get_paged_mqa_logits_metadata_triton",
        "deep_gemm": f"{_DG}:get_paged_mqa_logits_metadata",
    },
    "fp8_paged_mqa_logits": {
        "reference": f"{_REF}:fp8_paged_mqa_logits",
        "triton": f"{_IDX}:fp8_paged_mqa_logits_triton",
        "deep_gemm": f"{_DG}:fp8_paged_mqa_logits",
    },
    "pack_indexer_k_cache": {
        "reference": f"{_REF}:pack_indexer_k_cache",
    },
    # Lightning indexer over an MXFP4 key cache (DeepSeek-V4)
    "fp8_fp4_mqa_logits": {
        "reference": f"{_REF}:fp8_fp4_mqa_logits",
        "triton": "nsa_backend.kernels.indexer_fp4:fp8_fp4_mqa_logits_triton",
        "deep_gemm": f"{_DG}:fp8_fp4_mqa_logits",
    },
    "fp8_fp4_paged_mqa_logits": {
        "reference": f"{_REF}:fp8_fp4_paged_mqa_logits",
        "triton": "nsa_backend.kernels.indexer_fp4:fp8_fp4_paged_mqa_logits_triton",
        "deep_gemm": f"{_DG}:fp8_fp4_paged_mqa_logits",
    },
    "pack_indexer_k_cache_fp4": {
        "reference": f"{_REF}:pack_indexer_k_cache_fp4",
    },
    # Top-k selection
    "topk_indices": {
        "reference": f"{_REF}:topk_indices",
        "triton": f"{_TOPK}:topk_indices_triton",
    },
    "logical_to_global_indices": {
        "reference": f"{_REF}:logical_to_global_indices",
        "triton": f"{_TOPK}:logical_to_global_indices_triton",
    },
    # Sparse MLA
    "flash_mla_sparse_fwd": {
        "reference": f"{_REF}:flash_mla_sparse_fwd",
        "triton": f"{_PREFILL}:flash_mla_sparse_fwd_triton",
        "flash_mla": f"{_FMLA}:flash_mla_sparse_fwd",
    },
    "sparse_mla_decode": {
        "reference": f"{_REF}:sparse_mla_decode",
        "triton": f"{_DECODE}:sparse_mla_decode_triton",
        "flash_mla": f"{_FMLA}:sparse_mla_decode",
        "flashinfer": f"{_FI}:sparse_mla_decode",
    },
    "pack_fp8_ds_mla": {
        "reference": f"{_REF}:pack_fp8_ds_mla",
        "triton": f"{_DSMLA}:pack_fp8_ds_mla_triton",
    },
    "unpack_fp8_ds_mla": {
        "reference": f"{_REF}:unpack_fp8_ds_mla",
    },
    "write_fp8_ds_mla_cache": {
        "reference": f"{_REF}:write_fp8_ds_mla_cache",
        "triton": f"{_DSMLA}:write_fp8_ds_mla_cache_triton",
    },
    # DeepSeek-V4 KV cache (584-byte tokens)
    "pack_fp8_ds_mla_v4": {
        "reference": f"{_REF}:pack_fp8_ds_mla_v4",
        "triton": f"{_DSMLA_V4}:pack_fp8_ds_mla_v4_triton",
    },
    "unpack_fp8_ds_mla_v4": {
        "reference": f"{_REF}:unpack_fp8_ds_mla_v4",
        "triton": f"{_DSMLA_V4}:unpack_fp8_ds_mla_v4_triton",
    },
    "write_fp8_ds_mla_v4_cache": {
        "reference": f"{_REF}:write_fp8_ds_mla_v4_cache",
        "triton": f"{_DSMLA_V4}:write_fp8_ds_mla_v4_cache_triton",
    },
    # mHC
    "tf32_hc_prenorm_gemm": {
        "reference": f"{_REF}:tf32_hc_prenorm_gemm",
        "triton": f"{_MHC}:tf32_hc_prenorm_gemm_triton",
        "deep_gemm": f"{_DG}:tf32_hc_prenorm_gemm",
    },
}


# Implementations of one op for one input format whose function signature differs from the op's other
# implementations (DeepSeek-V4 decode takes a second cache and index list): ``(op, kv_format) -> {impl: path}``.
# Routing still decides per ``op`` (its ``kv_format`` feature keeps other implementations off these calls).
FORMAT_IMPLEMENTATIONS: dict[tuple[str, str], dict[str, str]] = {
    ("sparse_mla_decode", "fp8_ds_mla_v4"): {
        "reference": f"{_REF}:sparse_mla_decode",
        "triton": f"{_DECODE_V4}:sparse_mla_v4_decode_triton",
        "flash_mla": f"{_FMLA}:sparse_mla_decode",
    },
}


def custom_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the torch custom op ``name`` and return a caller that uses the op only when
    tracing (``torch.compile``), and calls ``fn`` directly in eager mode.

    Both paths run the same function; skipping the dispatcher in eager mode removes tens of
    microseconds of host time per call, which matters for decode steps run outside CUDA graphs.
    The returned caller exposes ``register_fake`` and the registered op as ``.op``.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.register_fake = op.register_fake  # type: ignore[attr-defined]
        call.op = op  # type: ignore[attr-defined]
        return call

    return wrap


def available_impls(op: str) -> list[str]:
    """Implementation names whose module is present in this installation (not necessarily usable)."""
    return [name for name, path in IMPLEMENTATIONS[op].items() if _module_present(path.split(":")[0])]


@functools.cache
def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def get_impl(op: str, impl: str, kv_format: str | None = None) -> Callable[..., Any]:
    """The function implementing ``op`` with ``impl`` (imported on first use); with ``kv_format``, the
    function of :data:`FORMAT_IMPLEMENTATIONS` for that input format."""
    if kv_format is not None:
        table = FORMAT_IMPLEMENTATIONS[(op, kv_format)]
        if impl not in table:
            raise ValueError(f"{op}: impl={impl!r} has no kernel for kv_format {kv_format!r}; "
                             f"available: {list(table)}")
        module, func = table[impl].split(":")
        return getattr(importlib.import_module(module), func)
    module, func = IMPLEMENTATIONS[op][impl].split(":")
    return getattr(importlib.import_module(module), func)


def resolve_impl(op: str, impl: str, features: dict[str, Any]) -> str:
    """Validate the name ``impl`` for ``op`` and resolve it with :func:`nsa_backend.routing.select_impl`.

    ``features`` carries ``device`` plus the shape features the capability table looks at.
    """
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected a str, one of {list(IMPL_NAMES)}, got {type(impl).__name__}")
    if impl not in IMPL_NAMES:
        raise ValueError(f"impl: expected one of {list(IMPL_NAMES)}, got {impl!r}")
    if impl != "auto" and impl not in IMPLEMENTATIONS[op]:
        raise ValueError(f"impl: {op} has no {impl!r} implementation; available: "
                         f"{['auto', *IMPLEMENTATIONS[op]]}")
    # Routing checks the rest (CPU tensors, the interpreter, installed kernels, natives, shapes).
    return select_impl(op, impl, features)
