"""Routing of vLLM's DeepGEMM ``tf32_hc_prenorm_gemm`` (DeepSeek-V4 mHC pre-norm GEMM) to nsa-backend.

vLLM's mHC layers call ``vllm.utils.deep_gemm.tf32_hc_prenorm_gemm(x, fn, out, sqrsum, n_splits)``
whenever vLLM considers DeepGEMM supported (SM90, SM100 and SM120 / SM121). :func:`install` replaces
that module attribute with :func:`routed_tf32_hc_prenorm_gemm`, which keeps DeepGEMM wherever the
DeepGEMM vLLM loads has a kernel for the GPU and accepts the shape (:func:`deep_gemm_serves_hc_prenorm`:
SM90 up to N = 32, SM100, and SM120 / SM121 with a build that has ``sm120_tf32_hc_prenorm_gemm``,
N <= 128 with N % 8 == 0, K % 64 == 0) and runs :func:`nsa_backend.tf32_hc_prenorm_gemm` elsewhere
(or everywhere with ``hc_prenorm = "on"``). The callers import the function at call time, so the
replacement reaches all of them.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

import nsa_backend
from nsa_backend_integrations.vllm.config import deep_gemm_serves_hc_prenorm

logger = logging.getLogger("nsa_backend.vllm")

DEEP_GEMM_MODULE = "vllm.utils.deep_gemm"
FUNCTION = "tf32_hc_prenorm_gemm"


@functools.lru_cache(maxsize=64)
def _native_serves(arch: str, n: int, k: int) -> bool:
    served, why = deep_gemm_serves_hc_prenorm(arch, n, k)
    logger.info("nsa-backend: tf32_hc_prenorm_gemm N=%d K=%d on %s: %s (%s)", n, k, arch,
                "vLLM's DeepGEMM" if served else "nsa-backend", why)
    return served


def _use_nsa(mode: str, device: torch.device, fn: torch.Tensor) -> bool:
    """Whether this call runs on nsa-backend: ``mode == "on"``, CPU tensors, or a GPU / shape
    (``fn`` is ``[N, K]``) the DeepGEMM vLLM loads has no kernel for."""
    if mode == "on" or device.type != "cuda":
        return True
    from nsa_backend.routing import detect_arch

    return not _native_serves(detect_arch(device), int(fn.shape[0]), int(fn.shape[-1]))


def make_routed(original: Callable[..., Any] | None, mode: str) -> Callable[..., Any]:
    """A ``tf32_hc_prenorm_gemm`` with DeepGEMM's signature that picks DeepGEMM or nsa-backend per call."""

    @functools.wraps(original or nsa_backend.tf32_hc_prenorm_gemm)
    def routed_tf32_hc_prenorm_gemm(
        x: torch.Tensor,
        fn: torch.Tensor,
        out: torch.Tensor,
        sqrsum: torch.Tensor,
        num_split: int | None = None,
    ) -> Any:
        """``out = x.float() @ fn.T`` and ``sqrsum = x.float().square().sum(-1)`` (split over K when
        ``out`` is ``[num_split, M, N]``)."""
        if original is None or _use_nsa(mode, x.device, fn):
            splits = num_split if out.dim() == 3 else None
            nsa_backend.tf32_hc_prenorm_gemm(x, fn, out, sqrsum, num_splits=splits)
            return None
        return original(x, fn, out, sqrsum, num_split)

    routed_tf32_hc_prenorm_gemm.nsa_backend_original = original  # type: ignore[attr-defined]
    return routed_tf32_hc_prenorm_gemm


def install(mode: str) -> Callable[..., Any] | None:
    """Replace ``vllm.utils.deep_gemm.tf32_hc_prenorm_gemm`` (idempotent). Returns the installed function."""
    if mode == "off":
        return None
    module = importlib.import_module(DEEP_GEMM_MODULE)
    current = getattr(module, FUNCTION, None)
    if current is not None and hasattr(current, "nsa_backend_original"):
        return current
    routed = make_routed(current, mode)
    setattr(module, FUNCTION, routed)
    logger.info("nsa-backend: %s.%s routed (hc_prenorm=%s)", DEEP_GEMM_MODULE, FUNCTION, mode)
    return routed
