"""DeepSeek-V4 attention of vLLM on nsa-backend (imports vLLM; loaded by ``plugin.register``).

vLLM builds DeepSeek-V4 attention from its own classes, picked per decoder layer by
``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls`` (FlashMLA everywhere but SM12x,
FlashInfer's SM120 kernels there); the attention-backend registry is never asked. On SM8x the
FlashMLA class fails ("only supported on SM90a and SM100f"), and on SM12x the FlashInfer class
refuses (heads, top-k) pairs FlashInfer has no kernel for.

:func:`install` wraps that selector (vLLM looks it up as a module global when it builds each layer)
so that it returns :class:`NsaDeepseekV4Attention` when

- nsa-backend is asked for by name (``--attention-backend CUSTOM`` while CUSTOM is nsa-backend's,
  or a takeover name nsa-backend serves, see :func:`nsa_backend_request`), or
- the ``[vllm] takeover`` setting is on (``auto``, ``on`` or a list), no backend is named, and the
  class vLLM would pick has no kernel for this GPU or this layer's (heads, top-k)
  (:func:`native_dsv4_kernel`);

otherwise vLLM's own choice is returned unchanged.

:class:`NsaDeepseekV4Attention` is vLLM's ``DeepseekV4Attention`` (its projections, compressor,
indexer, SWA cache layer and metadata builders: the FlashMLA backend classes, whose metadata it
reads) with the kernel calls replaced:

- KV-cache write: per-head query RMSNorm and GPT-J RoPE in torch, the new latent rows through
  :func:`nsa_backend.write_fp8_ds_mla_v4_cache` into the 584-byte UE8M0 SWA cache;
- attention (prefill and decode): :func:`nsa_backend.sparse_mla_decode` with
  ``kv_format="fp8_ds_mla_v4"``, one row per token, its sliding window in the SWA cache and its
  compressed keys (the indexer's top-k for C4A layers, every compressed token for C128A layers) as
  the extra key list, the attention sink included. Prefill tokens go through the same paged op
  (reading the fp8 pages in place) instead of a gathered bf16 copy;
- output projection: vLLM's inverse RoPE, then the grouped ``wo_a`` as a batched matmul where its
  weight is unquantised (an fp8 ``wo_a`` keeps vLLM's DeepGEMM einsum).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v4.attention import DeepseekV4Attention
from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant
from vllm.models.deepseek_v4.nvidia.flashmla import (
    DeepseekSparseSWAFlashMLABackend,
    DeepseekSparseSWAFlashMLAMetadataBuilder,
    DeepseekV4FlashMLAAttention,
)
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend

import nsa_backend
from nsa_backend.routing import capabilities as caps
from nsa_backend_integrations.vllm import dsv4_indexer
from nsa_backend_integrations.vllm.config import VllmSettings
from nsa_backend_integrations.vllm.plugin import CUSTOM_BACKEND_PATH, DSV4_MODEL_MODULE, TAKEOVER_BACKEND_PATHS

logger = logging.getLogger("nsa_backend.vllm")

MODEL_MODULE = DSV4_MODEL_MODULE
SELECTOR = "_select_dsv4_attn_cls"
V4_HEAD_DIM = 512
V4_FORMAT = "fp8_ds_mla_v4"


# --- selection --------------------------------------------------------------------------------------

def _registered_as(name: str, class_path: str) -> bool:
    """Whether vLLM's attention backend ``name`` resolves to ``class_path`` in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.__members__.get(name)
    return member is not None and member.is_overridden() and member.get_path() == class_path


def _backend_name(vllm_config: Any) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend if isinstance(backend, str) or backend is None else backend.name


def nsa_backend_request(vllm_config: Any) -> str | None:
    """How ``vllm_config`` names nsa-backend's attention (``"--attention-backend NAME"``), or ``None``.

    Named: ``CUSTOM`` while CUSTOM is nsa-backend's, or a takeover name (``FLASHMLA_SPARSE``,
    ``FLASHINFER_MLA_SPARSE_SM120``) while nsa-backend serves it. A name nsa-backend does not serve
    (vLLM's ``FLASHMLA_SPARSE_DSV4``, another plugin's CUSTOM) is not a request for it.
    """
    name = _backend_name(vllm_config)
    if name == "CUSTOM" and _registered_as("CUSTOM", CUSTOM_BACKEND_PATH):
        return "--attention-backend CUSTOM"
    if name in TAKEOVER_BACKEND_PATHS and _registered_as(name, TAKEOVER_BACKEND_PATHS[name]):
        return f"--attention-backend {name}"
    return None


def _local_heads(vllm_config: Any) -> int:
    heads = int(vllm_config.model_config.hf_config.num_attention_heads)
    return heads // max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))


def _vllm_flash_mla() -> caps.NativeStatus:
    """vLLM's bundled FlashMLA (``vllm._flashmla_C``) as a native package status."""
    import vllm
    from vllm.v1.attention.ops import flashmla

    # Whether the kernels were compiled into this wheel; the arch is checked against the table.
    ok, why = flashmla._is_flashmla_available()

    return caps.NativeStatus("flash_mla", bool(ok), vllm.__version__, None if ok else why)


def native_dsv4_kernel(vllm_config: Any, chosen: type, arch: str | None) -> tuple[bool, str]:
    """Whether the DeepSeek-V4 attention class ``chosen`` (vLLM's pick) has kernels for this model
    on arch family ``arch``, and why.

    FlashMLA classes: nsa-backend's capability table (``sparse_mla_decode`` over the 584-byte cache and
    ``flash_mla_sparse_fwd`` at ``d_qk`` 512, on the local head count) with vLLM's bundled FlashMLA as
    the package. FlashInfer SM120 classes: vLLM's own query of FlashInfer's DeepSeek-V4 dispatch table
    for (heads padded to FlashInfer's buckets, the window top-k). Any other class is vLLM's business
    (``True``).
    """
    if arch is None:
        return False, "no GPU"
    heads = _local_heads(vllm_config)
    name = chosen.__name__
    if "FlashInfer" in name:
        from vllm.models.deepseek_v4.nvidia import flashinfer_sparse as fi
        from vllm.utils.flashinfer import has_flashinfer_sparse_mla_sm120_config

        if "SM120" not in name:
            return True, f"{name} is vLLM's choice for a named backend"
        # Public names from vLLM 0.34; 0.33 has them with a leading underscore.
        pad = getattr(fi, "pad_to_supported_q_heads", None) or fi._pad_to_supported_q_heads
        required_topk = getattr(fi, "required_sm120_sparse_topk", None) or fi._required_sm120_sparse_topk
        try:
            padded = pad(heads)
        except ValueError as exc:
            return False, str(exc)
        window = int(vllm_config.model_config.hf_config.sliding_window)
        topk = required_topk(vllm_config, window)
        if has_flashinfer_sparse_mla_sm120_config(padded, topk):
            return True, f"FlashInfer has a DeepSeek-V4 SM120 kernel for (heads {padded}, top-k {topk})"
        return False, f"FlashInfer has no DeepSeek-V4 SM120 kernel for (heads {padded}, top-k {topk})"
    if "FlashMLA" in name:
        natives = {"flash_mla": _vllm_flash_mla()}
        block = int(getattr(vllm_config.cache_config, "block_size", 64) or 64)
        checks = {
            "sparse_mla_decode": {"num_heads": heads, "d_qk": V4_HEAD_DIM, "kv_format": V4_FORMAT,
                                  "page_size": block},
            "flash_mla_sparse_fwd": {"num_heads": heads, "d_qk": V4_HEAD_DIM},
        }
        for op, features in checks.items():
            verdict = caps.evaluate(op, "flash_mla", arch, features, natives)
            if not verdict.ok:
                return False, f"vLLM's FlashMLA: {verdict.reason}"
        return True, f"vLLM's FlashMLA serves {heads} heads on {arch}"
    return True, f"{name} is not a FlashMLA / FlashInfer class"


def _takeover_on(settings: VllmSettings | None) -> bool:
    return settings is not None and (settings.takeover == "auto" or bool(settings.takeover))


def select_attention(vllm_config: Any, original: Callable[[Any], type], settings: VllmSettings | None,
                     arch: str | None) -> tuple[type, str]:
    """The DeepSeek-V4 attention class for ``vllm_config`` and why (see the module docstring).

    Parameters
    ----------
    vllm_config : VllmConfig
        The model's config (``attention_config.backend``, heads, window).
    original : callable
        vLLM's ``_select_dsv4_attn_cls``.
    settings : VllmSettings, optional
        The ``[vllm]`` settings (``None``: takeover off).
    arch : str, optional
        Arch family of this process's GPU (``None`` without one).
    """
    asked = nsa_backend_request(vllm_config)
    if asked is not None:
        return NsaDeepseekV4Attention, f"nsa-backend named ({asked})"
    chosen = original(vllm_config)
    if not _takeover_on(settings) or _backend_name(vllm_config) is not None:
        return chosen, "vLLM's choice"
    served, why = native_dsv4_kernel(vllm_config, chosen, arch)
    if served:
        return chosen, why
    return NsaDeepseekV4Attention, f"takeover: {why}"


def _selector(original: Callable[[Any], type], settings: VllmSettings | None,
              arch: Callable[[], str | None]) -> Callable[[Any], type]:
    @functools.wraps(original)
    def select(vllm_config: Any) -> type:
        cls, why = select_attention(vllm_config, original, settings, arch())
        if cls is NsaDeepseekV4Attention:
            logger.info("nsa-backend: DeepSeek-V4 attention on nsa-backend (%s)", why)
            # The C4A indexer's logits (MXFP4 or FP8 keys) follow the attention: DeepGEMM's kernels miss
            # SM8x and most head counts on SM120.
            dsv4_indexer.install()
        return cls

    select.nsa_backend_original = original  # type: ignore[attr-defined]
    return select


def install(settings: VllmSettings | None, arch: Callable[[], str | None]) -> str:
    """Wrap vLLM's DeepSeek-V4 attention selector (idempotent); returns the wrapped function's path.

    ``arch`` is called at selection time (the GPU's arch family, ``None`` without one).
    """
    import importlib

    module = importlib.import_module(MODEL_MODULE)
    current = getattr(module, SELECTOR)
    original = getattr(current, "nsa_backend_original", current)
    setattr(module, SELECTOR, _selector(original, settings, arch))
    return f"{MODEL_MODULE}.{SELECTOR}"


# --- attention --------------------------------------------------------------------------------------

def _rope_gptj(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotation of ``x`` ``[T, ..., R]`` by ``cos_sin`` ``[T, R]`` (``[cos | sin]``)."""
    half = cos_sin.shape[-1] // 2
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [half]
    cos, sin = cos_sin[:, :half].float().view(shape), cos_sin[:, half:].float().view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _to_global(local: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-request logical positions ``local`` ``[T, K]`` (``-1``: none) to global cache slots."""
    valid = local >= 0
    pos = local.clamp(min=0).long()
    col = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.long()[req.long()[:, None], col]
    return torch.where(valid, blocks * block_size + pos % block_size, -1).to(torch.int32)


class NsaSparseSWAMetadataBuilder(DeepseekSparseSWAFlashMLAMetadataBuilder):
    """vLLM's SWA metadata builder of the FlashMLA path without FlashMLA's decode tile scheduler
    (``get_mla_metadata``, which needs vLLM's FlashMLA library; nsa-backend's decode plans nothing)."""

    def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, Any]:
        # vLLM's answer for a step without decode tokens: every layer type mapped to None.
        return super().build_tile_scheduler(0)


class NsaSparseSWABackend(DeepseekSparseSWAFlashMLABackend):
    """vLLM's SWA cache backend with :class:`NsaSparseSWAMetadataBuilder`."""

    @staticmethod
    def get_builder_cls() -> type[NsaSparseSWAMetadataBuilder]:
        return NsaSparseSWAMetadataBuilder


class NsaDeepseekV4Attention(DeepseekV4Attention):
    """vLLM's DeepSeek-V4 attention with nsa-backend's ops (see the module docstring).

    Keeps vLLM's FlashMLA backend classes for the metadata builders and KV-cache specs (584-byte
    ``fp8_ds_mla`` rows, block-split pages), so the caches and metadata are exactly vLLM's.
    """

    backend_cls = DeepseekV4FlashMLABackend
    swa_backend_cls = NsaSparseSWABackend

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        """nsa-backend's kernels take any head count: no padding."""
        return num_heads

    def _fused_qnorm_rope_kv_insert(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                                    attn_metadata: Any) -> torch.Tensor:
        """Queries: per-head RMSNorm (no weight) and GPT-J RoPE of the last ``rope_head_dim`` dims, in
        fp32, rounded to bf16 once. Keys: the normalised latent rows RoPE'd, quantised and stored by
        :func:`nsa_backend.write_fp8_ds_mla_v4_cache` into the SWA cache."""
        qf = q.float()
        qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + self.eps)
        if not isinstance(attn_metadata, dict):   # profiling run: no cache to write
            return qf.to(q.dtype)
        cos_sin = self.rotary_emb.cos_sin_cache.index_select(0, positions.long())
        rope = _rope_gptj(qf[..., self.nope_head_dim:], cos_sin)
        q_out = torch.cat([qf[..., : self.nope_head_dim], rope], dim=-1).to(q.dtype)
        swa_metadata = attn_metadata.get(self.swa_cache_layer.prefix)
        cache = self.swa_cache_layer.kv_cache
        if cache.dtype != torch.uint8:
            raise ValueError(f"nsa-backend DeepSeek-V4 attention: expected the fp8_ds_mla (uint8) SWA cache, "
                             f"got {cache.dtype}")
        pages = self._pages(cache, swa_metadata.block_size)
        slots = getattr(swa_metadata, "cache_slot_mapping", None)
        slots = swa_metadata.slot_mapping if slots is None else slots
        n = slots.shape[0]
        nsa_backend.write_fp8_ds_mla_v4_cache(kv[:n].contiguous(), pages, slots, None, positions[:n],
                                              self.rotary_emb.cos_sin_cache, self.eps)
        return q_out

    @staticmethod
    def _pages(cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """vLLM's ``[num_blocks, page_bytes]`` (or ``[num_blocks, P, 584]``) cache as ``[num_blocks, P, 584]``."""
        flat = cache.view(cache.shape[0], -1)
        return flat[:, : block_size * 584].view(cache.shape[0], block_size, 584)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: Any) -> None:
        """Sparse attention of every token of the batch (decodes and prefills alike) into ``output``."""
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):   # profiling run: no batch
            output.zero_()
            return
        swa = attn_metadata[self.swa_cache_layer.prefix]
        num_tokens = swa.num_decode_tokens + swa.num_prefill_tokens
        if num_tokens < output.shape[0]:
            output[num_tokens:].zero_()   # CUDA-graph padding rows
        if num_tokens == 0:
            return
        req = swa.token_to_req_indices[:num_tokens]
        pos = positions[:num_tokens].long()
        window = self.window_size
        # Sliding window: positions max(p - window + 1, replay start, 0) .. p of the SWA cache.
        offsets = torch.arange(window, device=pos.device)
        start = (pos - (window - 1)).clamp(min=0)
        if swa.replay_start is not None:
            start = torch.maximum(start, swa.replay_start.long()[req.long()])
        local = start[:, None] + offsets[None, :]
        local = torch.where(local <= pos[:, None], local, -1)
        swa_slots = _to_global(local, req, swa.block_table, swa.block_size)
        extra = {}
        if self.compress_ratio > 1:
            meta = attn_metadata[self.prefix]
            block_size = meta.block_size // self.compress_ratio
            if self.compress_ratio == 4:
                compressed = self.topk_indices_buffer[:num_tokens]
            else:
                # C128A attends to every compressed token before the query: (p + 1) // ratio of them.
                count = (pos + 1) // self.compress_ratio
                width = max(1, -(-self.max_model_len // self.compress_ratio))
                span = torch.arange(width, device=pos.device)[None, :]
                compressed = torch.where(span < count[:, None], span, -1)
            extra = {
                "extra_kv_cache": self._pages(self.kv_cache, block_size),
                "extra_indices": _to_global(compressed, req, meta.block_table, block_size)[:, None, :],
            }
        out, _ = nsa_backend.sparse_mla_decode(
            q[:num_tokens, None].contiguous(), self._pages(self.swa_cache_layer.kv_cache, swa.block_size),
            swa_slots[:, None, :], self.scale, V4_HEAD_DIM, kv_format=V4_FORMAT, attn_sink=self.attn_sink,
            **extra)
        output[:num_tokens] = out[:, 0]

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's inverse RoPE of the rope dims, then ``wo_a`` per head group and ``wo_b``."""
        weight = self.wo_a.weight
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            # A quantised wo_a: vLLM's FlashMLA-class projection (DeepGEMM's fp8 einsum).
            if not hasattr(self, "_einsum_recipe"):
                from vllm.models.deepseek_v4.nvidia.ops.o_proj import compute_fp8_einsum_recipe

                self._einsum_recipe, self._tma_aligned_scales = compute_fp8_einsum_recipe()
            return DeepseekV4FlashMLAAttention._o_proj(self, o, positions)
        x, _ = fused_inv_rope_fp8_quant(
            o, positions, self.rotary_emb.cos_sin_cache, n_groups=self.n_local_groups,
            heads_per_group=self.n_local_heads // self.n_local_groups, nope_dim=self.nope_head_dim,
            rope_dim=self.rope_head_dim, quantize=False)
        x = x.reshape(x.shape[0], self.n_local_groups, -1)   # [T, G, group_dim]
        w = weight.view(self.n_local_groups, self.o_lora_rank, -1)   # [G, r, group_dim]
        z = torch.bmm(x.transpose(0, 1).to(w.dtype), w.transpose(1, 2)).transpose(0, 1)  # [T, G, r]
        return self.wo_b(z.flatten(1))
