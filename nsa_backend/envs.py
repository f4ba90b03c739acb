"""Environment variables read by nsa-backend, all prefixed ``NSA_BACKEND_``.

| variable | type | default | meaning |
|---|---|---|---|
| NSA_BACKEND_CONFIG | path | unset | TOML config file (see docs/config.md) |
| NSA_BACKEND_FORCE_ARCH | str | unset | route as if the GPU were this arch family (e.g. ``sm120``) |
| NSA_BACKEND_LOG_LEVEL | str | ``WARNING`` | log level of the ``nsa_backend`` logger |
| NSA_BACKEND_INDEXER | str | unset | implementation for the indexer ops |
| NSA_BACKEND_TOPK | str | unset | implementation for top-k and index translation |
| NSA_BACKEND_PREFILL | str | unset | implementation for sparse MLA prefill |
| NSA_BACKEND_DECODE | str | unset | implementation for sparse MLA decode |
| NSA_BACKEND_HC_PRENORM | str | unset | implementation for the mHC pre-norm GEMM |
| NSA_BACKEND_SGLANG_TAKEOVER | bool | ``0`` | serve SGLang's ``dsa``/``nsa`` names with nsa-backend |
| NSA_BACKEND_VLLM_TAKEOVER | str | ``off`` | ``off``, ``auto``, ``on`` or vLLM sparse-MLA backend names |
| NSA_BACKEND_VLLM_INDEXER | str | ``auto`` | replace vLLM's ``SparseAttnIndexer`` (``auto``/``on``/``off``) |
| NSA_BACKEND_VLLM_HC_PRENORM | str | ``auto`` | route vLLM's mHC pre-norm GEMM to nsa-backend |
| NSA_BACKEND_GLUON | bool | ``1`` | ``0`` keeps the ``tl`` Triton kernels where a Gluon kernel exists |
| NSA_BACKEND_FAST_LAUNCH | bool | ``1`` | reuse kernels, replay eager calls per signature (``0``: Triton launches) |
| NSA_BACKEND_BENCH_SGLANG_ROOT | path | unset | directory holding ``sglang/`` for the benchmark's ``peers`` family |
| NSA_BACKEND_CACHE | path | ``~/.cache/nsa-backend`` | where the test scripts keep their virtual environments |
"""

from __future__ import annotations

import os

CONFIG = "NSA_BACKEND_CONFIG"
FORCE_ARCH = "NSA_BACKEND_FORCE_ARCH"
LOG_LEVEL = "NSA_BACKEND_LOG_LEVEL"
CACHE = "NSA_BACKEND_CACHE"
GLUON = "NSA_BACKEND_GLUON"
FAST_LAUNCH = "NSA_BACKEND_FAST_LAUNCH"
# One override per op family; the family names are the config-file keys.
FAMILY_VARS: dict[str, str] = {
    "indexer": "NSA_BACKEND_INDEXER",
    "topk": "NSA_BACKEND_TOPK",
    "prefill": "NSA_BACKEND_PREFILL",
    "decode": "NSA_BACKEND_DECODE",
    "hc_prenorm": "NSA_BACKEND_HC_PRENORM",
}


def get(name: str, default: str | None = None) -> str | None:
    """Value of an environment variable, with empty strings treated as unset."""
    value = os.environ.get(name)
    return value if value else default


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_mma_v3_disabled() -> bool:
    """True when Triton's Hopper MMA is off (``DISABLE_MMA_V3``, read by Triton's compiler as on / true / 1):
    ``tl.dot`` then lowers to mma.sync on sm_90 too."""
    return os.environ.get("DISABLE_MMA_V3", "").lower() in ("1", "true", "on")
