"""nsa-backend: DeepSeek Sparse Attention kernels for every NVIDIA GPU.

Flat public API. Every op takes a keyword ``impl`` (``"auto"``, ``"reference"``, ``"triton"``,
``"deep_gemm"``, ``"flash_mla"``, ``"flashinfer"`` where that implementation exists); ``"auto"``
routes by GPU architecture, shape and configuration.
"""

from nsa_backend._dispatch import IMPL_NAMES, IMPLEMENTATIONS

# DSA pipeline (framework-independent metadata -> indexer -> top-k -> sparse MLA)
from nsa_backend.dsa import TopkSelection, dsa_sparse_attention, dsa_topk

# Lightning indexer
from nsa_backend.indexer import (
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
    pack_indexer_k_cache,
    pack_indexer_k_cache_fp4,
)

# Batch metadata
from nsa_backend.metadata import DecodeBatch, PrefillBatch, SparseAttnMetadata, build_sparse_attn_metadata

# mHC pre-norm GEMM
from nsa_backend.mhc import tf32_hc_prenorm_gemm

# FP8 KV cache packing
from nsa_backend.quant import pack_fp8_ds_mla, unpack_fp8_ds_mla, write_fp8_ds_mla_cache

# DeepSeek-V4 KV cache packing (584-byte tokens)
from nsa_backend.quant_v4 import pack_fp8_ds_mla_v4, unpack_fp8_ds_mla_v4, write_fp8_ds_mla_v4_cache

# Sparse MLA attention
from nsa_backend.sparse_mla import flash_mla_sparse_fwd, sparse_mla_decode

# Top-k selection
from nsa_backend.topk import logical_to_global_indices, topk_indices

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "IMPL_NAMES",
    "DecodeBatch",
    "PrefillBatch",
    "SparseAttnMetadata",
    "TopkSelection",
    "__version__",
    "build_sparse_attn_metadata",
    "dsa_sparse_attention",
    "dsa_topk",
    "flash_mla_sparse_fwd",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "logical_to_global_indices",
    "pack_fp8_ds_mla",
    "pack_fp8_ds_mla_v4",
    "pack_indexer_k_cache",
    "pack_indexer_k_cache_fp4",
    "sparse_mla_decode",
    "tf32_hc_prenorm_gemm",
    "topk_indices",
    "unpack_fp8_ds_mla",
    "unpack_fp8_ds_mla_v4",
    "write_fp8_ds_mla_cache",
    "write_fp8_ds_mla_v4_cache",
]
