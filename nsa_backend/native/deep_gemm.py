"""DeepGEMM behind nsa-backend's signatures: indexer logits, paged metadata, mHC pre-norm GEMM.

Each function takes exactly the public op's parameters (already validated) and only translates
arguments:

- Heads: DeepGEMM takes H in {32, 64} on SM90 and {8, 16, 32, 64} on SM100 (64 only for the
  2.2-2.3 SM100 build). Fewer heads are zero-padded, with zero weights, so the logits are unchanged.
- ``context_lens``: DeepGEMM < 2.2 takes 1-D ``[B]`` only; 2.2-2.3 take 1-D or 2-D ``[B, next_n]``;
  2.4+ take 2-D only. A 1-D input is expanded to the equivalent 2-D lengths
  (row ``b*next_n + j`` sees keys ``t < L - next_n + j + 1``) and the schedule recomputed for it;
  a 2-D input with ``next_n == 1`` is squeezed for the 1-D-only releases.
- ``clean_logits``: DeepGEMM cleans only for 1-D context lengths and never in compressed output;
  elsewhere the kernel runs unclean and the ``-inf`` mask is written here.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from nsa_backend.routing.capabilities import deep_gemm_api_version, parse_version
from nsa_backend.routing.router import get_padded_heads


@functools.cache
def _module() -> ModuleType:
    return importlib.import_module("deep_gemm")


def _version() -> tuple[int, ...]:
    return parse_version(deep_gemm_api_version(_module()))


def context_lens_form() -> str:
    """``"1d"`` (DeepGEMM < 2.2), ``"both"`` (2.2 - 2.3) or ``"2d"`` (2.4+; forks by their API)."""
    version = _version()
    if version < (2, 2):
        return "1d"
    if version < (2, 4):
        return "both"
    return "2d"


def arch_supported(device: torch.device) -> tuple[bool, str]:
    """Whether the installed build runs on ``device``'s arch: its paged-metadata kernel is launched
    once (upstream raises "Unsupported architecture" on the host for SM120 before any launch)."""
    dg = _module()
    lens = torch.full((1, 1), 64, dtype=torch.int32, device=device)
    if context_lens_form() == "1d":
        lens = lens[:, 0].contiguous()
    num_sms = dg.get_num_sms() if hasattr(dg, "get_num_sms") else \
        torch.cuda.get_device_properties(device).multi_processor_count
    try:
        with torch.cuda.device(device):
            dg.get_paged_mqa_logits_metadata(lens, 64, num_sms)
    except Exception as exc:  # DeepGEMM reports an unsupported arch as RuntimeError
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return True, ""


def _pad_heads(x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    extra = target - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()


def expand_context_lens(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """1-D ``[B]`` lengths as the equivalent 2-D ``[B, next_n]`` (exclusive key limits per row)."""
    offsets = torch.arange(next_n, device=context_lens.device, dtype=context_lens.dtype)
    return (context_lens.view(-1, 1) - next_n + 1 + offsets.view(1, -1)).contiguous()


def _mask_paged(logits: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(logits.shape[1], device=logits.device)
    return logits.masked_fill(cols.view(1, -1) >= limits.reshape(-1, 1), float("-inf"))


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """``deep_gemm.fp8_mqa_logits`` with head padding and compressed-output cleaning."""
    dg = _module()
    heads = q.shape[1]
    target = get_padded_heads("fp8_mqa_logits", "deep_gemm", heads, device=q.device)
    q = _pad_heads(q, 1, target)
    weights = _pad_heads(weights, 1, target)
    compressed = max_seqlen_k > 0
    native_clean = clean_logits and not compressed
    logits = dg.fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, native_clean, max_seqlen_k)
    if clean_logits and compressed:
        width = (cu_seq_len_k_end - cu_seq_len_k_start).to(torch.int64)
        logits = _mask_paged(logits, width)
    return logits


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """``deep_gemm.get_paged_mqa_logits_metadata`` with the context_lens form the release takes."""
    dg = _module()
    form = context_lens_form()
    if form == "2d" and context_lens.dim() == 1:
        context_lens = context_lens.view(-1, 1)
    elif form == "1d" and context_lens.dim() == 2:
        if context_lens.shape[1] != 1:
            raise ValueError("context_lens: this DeepGEMM release takes 1-D context lengths only; 2-D lengths "
                             f"need next_n == 1, got shape {tuple(context_lens.shape)}")
        context_lens = context_lens[:, 0]
    return dg.get_paged_mqa_logits_metadata(context_lens.contiguous(), block_kv, num_sms)


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    """``deep_gemm.fp8_paged_mqa_logits`` with head padding and both context_lens forms."""
    dg = _module()
    _, next_n, heads, _ = q.shape
    target = get_padded_heads("fp8_paged_mqa_logits", "deep_gemm", heads, device=q.device)
    q = _pad_heads(q, 2, target)
    weights = _pad_heads(weights, 1, target)
    form = context_lens_form()
    limits = expand_context_lens(context_lens, next_n) if context_lens.dim() == 1 else context_lens
    if form == "2d" and context_lens.dim() == 1:
        # The schedule was computed for the 1-D form; rebuild it for the expanded lengths.
        context_lens = limits
        schedule_meta = dg.get_paged_mqa_logits_metadata(context_lens, kv_cache.shape[1],
                                                         schedule_meta.shape[0] - 1)
    elif form == "1d" and context_lens.dim() == 2:
        if next_n != 1:
            raise ValueError("context_lens: this DeepGEMM release takes 1-D context lengths only; 2-D lengths "
                             f"need next_n == 1, got next_n={next_n}")
        context_lens = context_lens[:, 0].contiguous()
    native_clean = clean_logits and context_lens.dim() == 1
    logits = dg.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                     max_context_len, native_clean)
    if clean_logits and not native_clean:
        logits = _mask_paged(logits, limits)
    return logits


def tf32_hc_prenorm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """``deep_gemm.tf32_hc_prenorm_gemm`` (writes ``d`` and ``sqr_sum``)."""
    _module().tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits)
