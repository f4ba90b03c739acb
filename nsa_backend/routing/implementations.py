"""Which implementations exist for each public op: ``"module:function"`` paths, as data.

``nsa_backend._dispatch`` imports a path on the first call that needs it; routing reads the table to know
which implementations an op has (and whether the Triton modules are installed) without importing any.
Every implementation function takes the public op's parameters (without ``impl``), already validated.
Triton paths name a kernel family package (``nsa_backend.kernels.<family>``), whose ``__init__`` holds the
entry points: checking that a path is installed then imports no kernel module.
"""

from __future__ import annotations

import functools
import importlib.util

IMPL_NAMES: tuple[str, ...] = ("auto", "reference", "triton", "deep_gemm", "flash_mla", "flashinfer")

_REF = "nsa_backend.reference"
_IDX = "nsa_backend.kernels.indexer"
_TOPK = "nsa_backend.kernels.topk"
_PREFILL = "nsa_backend.kernels.sparse_mla_prefill"
_DECODE = "nsa_backend.kernels.sparse_mla_decode"
_DSMLA = "nsa_backend.kernels.fp8_ds_mla"
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
        "triton": f"{_IDX}:fp8_fp4_mqa_logits_triton",
        "deep_gemm": f"{_DG}:fp8_fp4_mqa_logits",
    },
    "fp8_fp4_paged_mqa_logits": {
        "reference": f"{_REF}:fp8_fp4_paged_mqa_logits",
        "triton": f"{_IDX}:fp8_fp4_paged_mqa_logits_triton",
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
        "triton": f"{_DSMLA}:pack_fp8_ds_mla_v4_triton",
    },
    "unpack_fp8_ds_mla_v4": {
        "reference": f"{_REF}:unpack_fp8_ds_mla_v4",
        "triton": f"{_DSMLA}:unpack_fp8_ds_mla_v4_triton",
    },
    "write_fp8_ds_mla_v4_cache": {
        "reference": f"{_REF}:write_fp8_ds_mla_v4_cache",
        "triton": f"{_DSMLA}:write_fp8_ds_mla_v4_cache_triton",
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
        "triton": f"{_DECODE}:sparse_mla_v4_decode_triton",
        "flash_mla": f"{_FMLA}:sparse_mla_decode",
    },
}


def available_impls(op: str) -> list[str]:
    """Implementation names whose module is present in this installation (not necessarily usable)."""
    return [name for name, path in IMPLEMENTATIONS[op].items() if _module_present(path.split(":")[0])]


@functools.cache
def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
