"""Sparse MLA prefill kernels: the launcher, which picks a variant per call.

Variants (one module each):

- :mod:`.portable`: the ``tl`` attention tile kernel, for every architecture and the CPU interpreter (decode
  launches it too);
- :mod:`.sm90_gluon`: a Gluon kernel for sm_90, 64 heads per program (``h_q >= 17``);
- :mod:`.sm90_gluon_fewhead`: a Gluon kernel for sm_90 and few heads (``h_q <= 32``);
- :mod:`.sm80_gluon`: a Gluon mma.sync kernel for sm_80 / 86 / 89 / 120 / 121 (32 heads per program, ``q`` in
  registers), for the head counts of ``MMA_V2_PREFILL_HEADS``; under the sm120 proxy an sm_90 GPU runs it;
- :mod:`.common`: host-side pieces the variants share.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import AttnConfig, heads_per_program, prefill_config
from nsa_backend.kernels._arch import device_arch
from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as mma_v2
from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon as gluon_prefill
from nsa_backend.kernels.sparse_mla_prefill import sm90_gluon_fewhead as gluon_fewhead
from nsa_backend.kernels.sparse_mla_prefill.common import LOG2E, fp8_native, prefill_outputs
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_fwd_kernel

__all__ = ["MMA_V2_PREFILL_HEADS", "PREFILL_KERNELS", "flash_mla_sparse_fwd_triton", "prefill_kernel"]

# Head counts whose bf16 prefill takes the mma.sync Gluon kernel of ``sm80_gluon`` on its archs (32-head programs).
# H100 under the sm_120 proxy, s_q 4096, s_kv 32768, topk 2048, CUDA graphs, against the tl tile in the same run:
# 1.89-1.90x at h_q 32-128, 1.41x at 16 (bench/results/h100-proxy-sm120/prefill-mma-v2).
MMA_V2_PREFILL_HEADS: frozenset[int] = frozenset(range(1, 129))
# The kernels ``flash_mla_sparse_fwd_triton`` launches (:func:`prefill_kernel`), in words.
PREFILL_KERNELS: dict[str, str] = {
    "sm90_gluon_fewhead": "Gluon few-head prefill (sparse_mla_prefill/sm90_gluon_fewhead.py)",
    "sm90_gluon": "Gluon 64-head prefill (sparse_mla_prefill/sm90_gluon.py)",
    "sm80_gluon": "Gluon mma.sync prefill (sparse_mla_prefill/sm80_gluon.py)",
    "portable": "portable tl prefill tile (sparse_mla_prefill/portable.py)",
}


def prefill_kernel(q: torch.Tensor, kv: torch.Tensor, d_v: int, arch: int | None) -> str:
    """The kernel :func:`flash_mla_sparse_fwd_triton` launches for this call on ``sm_<arch>`` (``None``: off CUDA)
    without a ``config``: a key of ``PREFILL_KERNELS``. Only the tensors' shapes, strides, dtypes and alignment
    count, so a planner can ask with stand-ins of the call's tensors."""
    if arch is None:
        return "portable"
    if gluon_fewhead.supported(q, kv, d_v, arch):
        return "sm90_gluon_fewhead"
    if gluon_prefill.supported(q, kv, d_v, arch):
        return "sm90_gluon"
    if q.shape[1] in MMA_V2_PREFILL_HEADS and mma_v2.supported(q, kv, d_v, arch):
        return "sm80_gluon"
    return "portable"


def flash_mla_sparse_fwd_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    config: AttnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`nsa_backend.flash_mla_sparse_fwd` (see :mod:`.portable` for the tiling).

    Parameters
    ----------
    q : torch.Tensor
        ``[s_q, h_q, d_qk]`` ``bfloat16``, contiguous; ``d_qk`` in {512, 576}.
    kv : torch.Tensor
        ``[s_kv, 1, d_qk]`` ``bfloat16``, contiguous; ``V`` is the first ``d_v`` dims.
    indices : torch.Tensor
        ``[s_q, 1, topk]`` ``int32``; ``-1`` and values ``>= s_kv`` are skipped.
    sm_scale : float
        Softmax scale applied to ``q . k``.
    d_v : int
        Value head dim (512).
    attn_sink : torch.Tensor, optional
        ``[h_q]`` ``float32``: ``out *= exp(lse) / (exp(lse) + exp(sink))``.
    topk_length : torch.Tensor, optional
        ``[s_q]`` ``int32``: row ``i`` uses its first ``topk_length[i]`` indices.
    config : AttnConfig, optional
        Launch configuration of the ``tl`` kernel, overriding
        ``nsa_backend.configs.sparse_mla.prefill_config``. Without one, calls that
        ``nsa_backend.kernels.sparse_mla_prefill.sm90_gluon_fewhead.supported`` accepts (sm_90, bf16, ``d_qk``
        576, ``h_q <= 32``, when enabled) run the few-head Gluon kernel, and calls that
        ``nsa_backend.kernels.sparse_mla_prefill.sm90_gluon.supported`` accepts (sm_90, bf16, ``d_qk`` 576,
        ``h_q >= 17``) the 64-head Gluon kernel, and calls of ``MMA_V2_PREFILL_HEADS`` heads that
        ``nsa_backend.kernels.sparse_mla_prefill.sm80_gluon.supported`` accepts (sm_80 / 86 / 89 / 120 / 121,
        bf16, ``d_qk`` 576) the mma.sync Gluon kernel.

    Returns
    -------
    tuple of torch.Tensor
        ``out [s_q, h_q, d_v] bfloat16``, ``max_logits [s_q, h_q] float32`` (scaled logits),
        ``lse [s_q, h_q] float32`` (natural log; ``+inf`` and ``out = 0`` for rows without a key).
    """
    arch = device_arch(q.device)
    kernel = prefill_kernel(q, kv, d_v, arch) if config is None else "portable"
    if kernel == "sm90_gluon_fewhead":
        return gluon_fewhead.flash_mla_sparse_fwd_gluon_fewhead(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if kernel == "sm90_gluon":
        return gluon_prefill.flash_mla_sparse_fwd_gluon(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if kernel == "sm80_gluon":
        return mma_v2.flash_mla_sparse_fwd_mma_v2(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    block_h = heads_per_program(h_q, arch)
    cfg = config or prefill_config(block_h, arch)
    kv2 = kv.view(s_kv, d_qk)
    idx = indices.view(s_q, topk)
    grid = (s_q, triton.cdiv(h_q, cfg.block_h), 1)
    _sparse_mla_fwd_kernel[grid](
        q, kv2, idx, attn_sink, topk_length,
        out, lse, max_logits,
        sm_scale * LOG2E,
        h_q, topk, s_kv, max(s_kv, 1), topk, 1,
        q.stride(0), q.stride(1), idx.stride(0),
        0, kv2.stride(0),
        out.stride(0), 0, 0, out.stride(1),
        lse.stride(0), 0, 0, lse.stride(1),
        D_ROPE=d_qk - d_v,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        KV_FP8=False, FP8_NATIVE=fp8_native(arch), SPLIT=False,
        IDX_AHEAD=cfg.idx_ahead, SHARE_KEYS=False, REREAD_KEYS=False,
        **cfg.launch_options(),
    )
    return out, max_logits, lse
