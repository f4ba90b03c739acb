"""Host-side pieces shared by the sparse MLA prefill variants (and decode): constants, output buffers
and the e4m3 decoding switch (heads per program: :func:`nsa_backend.configs.sparse_mla.heads_per_program`)."""

from __future__ import annotations

import torch

from nsa_backend.kernels.aot import FP8_NATIVE_MIN_ARCH

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def fp8_native(arch: int | None) -> bool:
    """Whether kernels use Triton's e4m3 type on ``sm_<arch>`` (``None``: the interpreter, yes)."""
    return arch is None or arch >= FP8_NATIVE_MIN_ARCH


def prefill_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised results of a prefill launch on ``q``'s device: ``out [s_q, h_q, d_v]`` bfloat16,
    ``max_logits`` and ``lse [s_q, h_q]`` float32 (the order the op returns them in)."""
    s_q, h_q, _ = q.shape
    out = torch.empty(s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    return out, max_logits, lse

