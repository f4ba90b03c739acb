"""Which Triton kernel a planned sparse MLA call takes, in words, for ``nsa-backend plan`` and ``doctor``.

The sparse MLA launchers pick a kernel per call: a Gluon kernel written for the GPU's arch (sm_90, or the mma.sync
archs sm_80 / 86 / 89 / 120 / 121) where it covers the shapes, else the portable ``tl`` tile. They decide from the
tensors' shapes, strides, dtypes and alignment and the arch only (``prefill_kernel``, ``decode_kernel``), so the
plan asks the same functions with small stand-ins of the planned call's tensors: the answer is the launcher's own,
for this installation's Triton and ``NSA_BACKEND_GLUON``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nsa_backend.kernels._arch import FAMILY_CAPABILITY
from nsa_backend.kernels.sparse_mla_decode import DECODE_KERNELS, decode_kernel
from nsa_backend.kernels.sparse_mla_prefill import PREFILL_KERNELS, prefill_kernel
from nsa_backend.reference import DS_MLA_TOKEN_BYTES

# The DeepSeek-V4 cache has its own decode tile (``sparse_mla_v4_decode_triton``).
V4_DECODE_KERNEL = "DeepSeek-V4 decode tile (sparse_mla_decode/v4.py)"
D_V = 512


def planned_triton_kernel(op: str, arch: str, features: Mapping[str, Any]) -> str | None:
    """The Triton kernel ``op`` takes for a call with ``features`` (the plan's) on arch family ``arch``, or ``None``
    for the ops whose launcher has one kernel (or whose choice depends on more than the plan knows)."""
    capability = FAMILY_CAPABILITY.get(arch)
    heads, d_qk = features.get("num_heads"), features.get("d_qk")
    if heads is None or d_qk is None:
        return None
    if op == "flash_mla_sparse_fwd":
        q = torch.empty(1, heads, d_qk, dtype=torch.bfloat16)
        kv = torch.empty(1, 1, d_qk, dtype=torch.bfloat16)
        return PREFILL_KERNELS[prefill_kernel(q, kv, D_V, capability)]
    if op == "sparse_mla_decode":
        kv_format = features.get("kv_format", "fp8_ds_mla")
        if kv_format == "fp8_ds_mla_v4":
            return V4_DECODE_KERNEL
        page = features.get("page_size", 64)
        q = torch.empty(1, features.get("s_q", 1), heads, d_qk, dtype=torch.bfloat16)
        if kv_format == "fp8_ds_mla":
            cache = torch.empty(1, page, 1, DS_MLA_TOKEN_BYTES, dtype=torch.uint8)
        else:
            cache = torch.empty(1, page, 1, d_qk, dtype=torch.bfloat16)
        return DECODE_KERNELS[decode_kernel(q, cache, kv_format, D_V, capability)]
    return None
