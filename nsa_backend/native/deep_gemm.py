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

MXFP4 key cache (``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits``, the DeepGEMM 2.8 API bundled with
vLLM 0.34): DeepGEMM takes ``q = (values, scales)`` and ``kv = (values, scales)`` of one element type, so
only MXFP4 queries (packed e2m1 as ``int8`` with ``int32`` UE8M0 scales) reach it (routing keeps e4m3
queries off it). Its ragged kernel writes compressed output only (``max_seqlen_k > 0``) and cleans
nothing; its paged kernel takes 2-D context lengths, and on SM100 only the varlen form (one query row
per request, a request index per row). Full-width output, the ``-inf`` masks, the 2-D lengths, the
varlen rows and the DeepGEMM schedule for them are made here (the caller's ``schedule_meta`` may come
from another implementation: only its SM count is used).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from nsa_backend._settings import padded_heads
from nsa_backend.native.versions import deep_gemm_api_version, parse_version


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
    target = padded_heads("fp8_mqa_logits", "deep_gemm", heads, q.device)
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
    target = padded_heads("fp8_paged_mqa_logits", "deep_gemm", heads, q.device)
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


def _arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _fp4_q(q: torch.Tensor, q_scale: torch.Tensor | None, head_dim: int, target: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our MXFP4 queries (``uint8 [..., H, 64]`` values, ``uint8 [..., H, 4]`` scales) as DeepGEMM's pair
    (``int8`` values, ``int32 [..., H]`` scales), zero-padded to ``target`` heads (zero values: the
    padded heads' logits are 0 and their weights 0)."""
    if q_scale is None:
        raise ValueError("q_scale: DeepGEMM's fp8_fp4 logits take MXFP4 queries with their UE8M0 scales here "
                         "(e4m3 queries against an MXFP4 cache need impl='triton' or 'reference'), got None")
    values = _pad_heads(q.view(torch.int8), head_dim, target)
    scales = _pad_heads(q_scale.contiguous().view(torch.int32).squeeze(-1), head_dim, target)
    return values, scales


def fp8_fp4_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """``deep_gemm.fp8_fp4_mqa_logits`` for MXFP4 ``q [S, H, 64]`` / ``k [N, 64]`` (``uint8`` scales
    ``[S, H, 4]`` / ``[N, 4]``); returns ``float32`` ``[S, N]`` or ``[S, max_seqlen_k]``."""
    dg = _module()
    heads = q.shape[1]
    target = padded_heads("fp8_fp4_mqa_logits", "deep_gemm", heads, q.device)
    q_pair = _fp4_q(q, q_scale, 1, target)
    weights = _pad_heads(weights, 1, target)
    num_keys = k.shape[0]
    kv = (k.view(torch.int8), k_scale.contiguous().view(torch.int32).view(num_keys))
    # DeepGEMM writes compressed rows only: full-width output is the compressed one N wide, moved to ks.
    width = max_seqlen_k if max_seqlen_k > 0 else max(num_keys, 1)
    logits = dg.fp8_fp4_mqa_logits(q_pair, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, width,
                                   logits_dtype=torch.float32)
    starts = cu_seq_len_k_start.to(torch.int64).view(-1, 1)
    ends = cu_seq_len_k_end.to(torch.int64).view(-1, 1)
    if max_seqlen_k > 0:
        return _mask_paged(logits, ends - starts) if clean_logits else logits
    cols = torch.arange(num_keys, device=logits.device).view(1, -1)
    rel = cols - starts
    full = logits.gather(1, rel.clamp(0, width - 1).expand(logits.shape[0], num_keys))
    if not clean_logits:
        return full
    return full.masked_fill((rel < 0) | (cols >= ends), float("-inf"))


def fp8_fp4_paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor | None,
    max_context_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    """``deep_gemm.fp8_fp4_paged_mqa_logits`` for MXFP4 ``q [B, next_n, H, 64]`` over the 68-byte paged
    cache; returns ``float32`` ``[B * next_n, max_context_len]``."""
    dg = _module()
    batch, next_n, heads, _ = q.shape
    target = padded_heads("fp8_fp4_paged_mqa_logits", "deep_gemm", heads, q.device)
    values, scales = _fp4_q(q, q_scale, 2, target)
    weights = _pad_heads(weights, 1, target)
    limits = expand_context_lens(context_lens, next_n) if context_lens.dim() == 1 else context_lens.contiguous()
    block_kv = kv_cache.shape[1]
    num_sms = schedule_meta.shape[0] - 1 if schedule_meta is not None else dg.get_num_sms()
    kwargs = {}
    if _arch_major(q.device) == 10:
        # SM100 takes the varlen form only: every query row its own request with next_n 1, and the
        # index of the request (block_table row) it reads.
        rows = batch * next_n
        values, scales = values.reshape(rows, 1, target, -1), scales.reshape(rows, 1, target)
        lens = limits.reshape(rows, 1).contiguous()
        indices = torch.arange(batch, device=q.device, dtype=torch.int32).repeat_interleave(next_n)
        kwargs["indices"] = indices
    else:
        lens = limits
    sched = dg.get_paged_mqa_logits_metadata(lens, block_kv, num_sms, **kwargs)
    logits = dg.fp8_fp4_paged_mqa_logits((values, scales), kv_cache, weights, lens, block_table, sched,
                                         max_context_len, logits_dtype=torch.float32, **kwargs)
    return _mask_paged(logits, limits) if clean_logits else logits


def tf32_hc_prenorm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """``deep_gemm.tf32_hc_prenorm_gemm`` (writes ``d`` and ``sqr_sum``)."""
    _module().tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits)
