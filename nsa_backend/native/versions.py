"""Version strings of the native packages: their numeric release and, for DeepGEMM, the upstream API level.

Read by routing (which rows of the capability table a package satisfies) and by the DeepGEMM wrapper.
"""

from __future__ import annotations

import re
from typing import Any


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string (``"0.6.18.post1+cu13"`` -> ``(0, 6, 18)``)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if not match:
        return (0,)
    return tuple(int(p) for p in match.group(1).split("."))


def deep_gemm_api_version(module: Any) -> str:
    """Upstream DeepGEMM release whose API ``module`` matches.

    Upstream releases declare ``__version__`` (2.2+). Forks number their own releases
    (``sgl-deep-gemm`` 0.2.x reports ``0.2.3.post2``), so the API is read from the functions they
    export instead: ``bf16_mega_moe`` arrived in 2.6, ``fp8_fp4_paged_mqa_logits`` (2-D context
    lengths only) in 2.4, ``tf32_hc_prenorm_gemm`` in 2.3.
    """
    declared = getattr(module, "__version__", None)
    if declared is not None and parse_version(str(declared)) >= (2, 2):
        return str(declared)
    if hasattr(module, "bf16_mega_moe"):
        return "2.6"
    if hasattr(module, "fp8_fp4_paged_mqa_logits"):
        return "2.4"
    if hasattr(module, "tf32_hc_prenorm_gemm"):
        return "2.3"
    return "2.1"
