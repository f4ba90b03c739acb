"""nsa-backend sparse-MLA attention backend for vLLM (DeepSeek-V3.2, GLM-5 and other DSA models).

Three classes in vLLM's backend shape:

- :class:`NsaSparseMLABackend` declares what the backend serves: bf16 activations, ``bfloat16``
  and ``fp8_ds_mla`` KV caches, 64-token blocks, head sizes 576 (512 latent + 64 rope) and 512
  (rope-free), compute capability 8.0 and up, MLA and sparse. Registered as
  ``AttentionBackendEnum.CUSTOM``; :class:`FlashMLASparseTakeoverBackend` and
  :class:`FlashInferSM120TakeoverBackend` are the same backend under vLLM's names for the
  ``takeover`` setting.
- :class:`NsaSparseMLAMetadataBuilder` turns vLLM's ``CommonAttentionMetadata`` into
  :class:`~nsa_backend_integrations.vllm.metadata.NsaSparseMLAMetadata` once per batch; its
  ``core`` field is the batch as :class:`nsa_backend.metadata.SparseAttnMetadata`.
- :class:`NsaSparseMLAImpl` runs the attention of one layer over the indexer's top-k positions
  with :func:`nsa_backend.dsa.dsa_sparse_attention` on ``core``: decode tokens with
  :func:`nsa_backend.sparse_mla_decode` straight from the paged cache, prefill tokens with
  :func:`nsa_backend.flash_mla_sparse_fwd` over bf16 rows (the fp8_ds_mla rows a prefill selects
  are dequantised first). Both ops route by GPU (``impl="auto"``).

KV-cache layouts (one latent head per token, ``page`` = 64 tokens per block):

- ``bfloat16``: ``[num_blocks, page, 576]`` bf16, the 512 latent values then the 64 rope values.
- ``fp8_ds_mla``: ``[num_blocks, page, 656]`` uint8; bytes ``[0, 512)`` the latent values in e4m3,
  ``[512, 528)`` four fp32 scales (one per 128 values), ``[528, 656)`` the 64 rope values in bf16.

Blocks may be spaced further apart than ``page`` rows (``stride(0)``) when layers share pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

import nsa_backend
from nsa_backend.dsa import TopkSelection, cache_rows, dsa_sparse_attention
from nsa_backend.metadata import (
    SparseAttnMetadata,
    build_decode_batch,
    build_prefill_batch,
    token_request_ids,
)
from nsa_backend_integrations.vllm.config import announce_model
from nsa_backend_integrations.vllm.metadata import NsaSparseMLAMetadata, split_decodes_and_prefills

# Latent (value) width of every DSA model served here; also the d_v of the attention ops.
KV_LORA_RANK = 512
# Tokens per KV-cache block read by the kernels.
KERNEL_BLOCK_SIZE = 64
FP8_DS_MLA_BYTES = 656
# Fallback top-k width when the model config does not say (every current DSA model uses 2048).
DEFAULT_INDEX_TOPK = 2048


def _model_hf_config() -> Any | None:
    """The current model's HF text config, or None outside a model config context."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "hf_text_config", None) if model_config is not None else None


class NsaSparseMLABackend(AttentionBackend):
    """DeepSeek Sparse Attention (sparse MLA) on nsa-backend's routed kernels."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16", "fp8_ds_mla"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[NsaSparseMLAImpl]:
        return NsaSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[NsaSparseMLAMetadataBuilder]:
        return NsaSparseMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        # Prefill reads the cache as flat rows: blocks must be a whole number of rows apart.
        if "block_stride_alignment" not in getattr(spec, "__dataclass_fields__", {}):
            return spec
        row_bytes = getattr(spec, "state_content_size_bytes", None)
        return dataclasses.replace(spec, block_stride_alignment=row_bytes) if row_bytes else spec

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # 576 = 512 latent + 64 rope (DeepSeek-V3.2, GLM-5); 512 = rope-free latent.
        return [576, 512]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return (capability.major, capability.minor) >= (8, 0)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        name = cls.get_name()
        if head_size == 512 and cls._canonical_kv_cache_dtype(kv_cache_dtype) == "fp8_ds_mla":
            return (
                f"{name} (nsa-backend) stores fp8_ds_mla rows of 576 values; head_size 512 needs a bf16 cache"
            )
        hf_config = _model_hf_config()
        if hf_config is not None and getattr(hf_config, "index_topk", None) is None:
            return f"{name} (nsa-backend) requires a model with index_topk config"
        return None

    @classmethod
    def _canonical_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> str | None:
        """The cache format vLLM's MLA layer will use for ``kv_cache_dtype`` with this backend."""
        return kv_cache_dtype


class _TakeoverBackend(NsaSparseMLABackend):
    """nsa-backend serving one of vLLM's sparse-MLA backend names.

    vLLM keys some behaviour on the backend name (for these names it maps ``fp8`` / ``fp8_e4m3``
    KV caches to ``fp8_ds_mla``), so the takeover classes keep the name of the backend they replace
    and accept the fp8 aliases that vLLM rewrites.
    """

    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "bfloat16",
        "fp8_ds_mla",
        "fp8",
        "fp8_e4m3",
    ]

    @classmethod
    def _canonical_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> str | None:
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return "fp8_ds_mla"
        return kv_cache_dtype


class FlashMLASparseTakeoverBackend(_TakeoverBackend):
    """nsa-backend under the name ``FLASHMLA_SPARSE``."""

    @staticmethod
    def get_name() -> str:
        return "FLASHMLA_SPARSE"


class FlashInferSM120TakeoverBackend(_TakeoverBackend):
    """nsa-backend under the name ``FLASHINFER_MLA_SPARSE_SM120`` (vLLM also maps ``auto`` to fp8_ds_mla)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA_SPARSE_SM120"

    @classmethod
    def _canonical_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> str | None:
        if kv_cache_dtype in (None, "auto", "fp8", "fp8_e4m3"):
            return "fp8_ds_mla"
        return kv_cache_dtype


def check_impl_choice(vllm_config: Any, kv_cache_dtype: str, device: torch.device) -> None:
    """Fail at start-up when the configured prefill / decode implementation cannot serve this model
    on this GPU with this cache (``nsa_backend.routing.validate_impl_choice``; raises its
    ``ImplChoiceError`` naming the valid choices). ``auto`` choices are not checked."""
    from nsa_backend.routing import MODEL_ARCHS, detect_arch, get_config, validate_impl_choice

    architectures = getattr(vllm_config.model_config, "architectures", None) or []
    model = architectures[0] if architectures else None
    if model not in MODEL_ARCHS:
        return
    arch = detect_arch(device)
    config = get_config()
    prefill, _ = config.choice("prefill", arch, model)
    decode, _ = config.choice("decode", arch, model)
    if prefill == "auto" and decode == "auto":
        return
    kv = "fp8_ds_mla" if kv_cache_dtype == "fp8_ds_mla" else "bfloat16"
    names = {"flash_mla": "flashmla_sparse", "flashinfer": "flashinfer_sparse_mla"}
    decode_names = {**names, "flash_mla": "flashmla_kv" if kv == "fp8_ds_mla" else "flashmla_sparse"}
    validate_impl_choice(model, arch, kv, names.get(prefill, prefill), decode_names.get(decode, decode))


class NsaSparseMLAMetadataBuilder(AttentionMetadataBuilder[NsaSparseMLAMetadata]):
    """Builds :class:`NsaSparseMLAMetadata` from vLLM's ``CommonAttentionMetadata``.

    Decode-only batches of equal query length (1, or 1 + speculative tokens) replay CUDA graphs:
    the tensors the impl reads (per-token request ids, the decode rows' visible key counts) live in
    persistent buffers or are vLLM's own persistent tensors, and are computed without a host sync.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        announce_model(vllm_config)
        cache_dtype = getattr(kv_cache_spec, "cache_dtype_str", None) or vllm_config.cache_config.cache_dtype
        check_impl_choice(vllm_config, cache_dtype, torch.device(device))
        hf_config = getattr(vllm_config.model_config, "hf_text_config", None)
        self.topk_tokens = int(getattr(hf_config, "index_topk", None) or DEFAULT_INDEX_TOPK)
        self.block_size = int(kv_cache_spec.block_size)
        max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self._req_id_per_token = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self._decode_context_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        init_threshold = getattr(self, "_init_reorder_batch_threshold", None)
        if init_threshold is not None:
            # Decodes (and speculative verification rows) first, prefills after.
            init_threshold(1, supports_spec_as_decode=True)
        else:
            self.reorder_batch_threshold = 1

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> NsaSparseMLAMetadata:
        cm = common_attn_metadata
        num_tokens = int(cm.num_actual_tokens)
        max_tokens = self._req_id_per_token.numel()
        if num_tokens > max_tokens:
            raise ValueError(f"batch of {num_tokens} tokens exceeds max_num_batched_tokens={max_tokens}")
        threshold = self.reorder_batch_threshold or 1
        qsl_cpu = cm.query_start_loc_cpu
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            qsl_cpu, num_tokens, threshold
        )
        req_id_per_token = token_request_ids(cm.query_start_loc, num_tokens, out=self._req_id_per_token)
        core = SparseAttnMetadata(
            page_size=self.block_size, num_tokens=num_tokens, slot_mapping=cm.slot_mapping[:num_tokens].long()
        )

        decode_max_query_len = 0
        if num_decodes:
            decode_max_query_len = int((qsl_cpu[1 : num_decodes + 1] - qsl_cpu[:num_decodes]).max())
            # One row per token: under speculative decoding the per-request split is decided on the device.
            core.decode = build_decode_batch(
                cm.query_start_loc,
                cm.seq_lens,
                cm.block_table_tensor,
                req_id_per_token[:num_decode_tokens],
                max_context_len=int(cm.max_seq_len),
                context_lens=self._decode_context_lens,
            )
        prefill_max_seq_len = 0
        if num_prefills:
            # Exact for prefill rows (vLLM's upper bound is optimistic only for speculative decodes).
            seq_lens_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
            if seq_lens_cpu is None:
                seq_lens_cpu = getattr(cm, "seq_lens_cpu", None)
            if seq_lens_cpu is None:
                seq_lens_cpu = cm.seq_lens.cpu()
            prefill_lens = seq_lens_cpu[num_decodes : num_decodes + num_prefills]
            prefill_max_seq_len = int(prefill_lens.max())
            core.prefill = build_prefill_batch(
                cm.query_start_loc,
                cm.seq_lens[: num_decodes + num_prefills],
                cm.block_table_tensor,
                req_id_per_token[num_decode_tokens:],
                self.block_size,
                first_req=num_decodes,
                token_start=num_decode_tokens,
                num_keys=int(prefill_lens.sum()),
            )

        return NsaSparseMLAMetadata(
            num_reqs=int(cm.num_reqs),
            num_actual_tokens=num_tokens,
            max_query_len=int(cm.max_query_len),
            max_seq_len=int(cm.max_seq_len),
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            req_id_per_token=req_id_per_token,
            block_size=self.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            decode_max_query_len=decode_max_query_len,
            prefill_max_seq_len=prefill_max_seq_len,
            core=core,
        )


def _kv_format(kv_cache_dtype: str) -> str:
    if kv_cache_dtype == "fp8_ds_mla":
        return "fp8_ds_mla"
    if kv_cache_dtype in ("auto", "bfloat16"):
        return "bf16"
    raise NotImplementedError(
        f"nsa-backend sparse MLA: kv_cache_dtype {kv_cache_dtype!r} is not supported; "
        "use 'fp8_ds_mla' or 'bfloat16'"
    )


def _fp8_ds_mla_scale_format() -> str:
    """Scale rounding of fp8_ds_mla rows written here: GLM checkpoints use arbitrary fp32 scales,
    DeepSeek ones powers of two. Reading accepts both."""
    hf_config = _model_hf_config()
    model_type = str(getattr(hf_config, "model_type", "") or "")
    return "arbitrary" if model_type.startswith("glm") else "pow2"


class NsaSparseMLAImpl(MLAAttentionImpl[NsaSparseMLAMetadata]):
    """Sparse MLA of one layer: every token attends to the ``index_topk`` positions its indexer chose."""

    is_sparse: ClassVar[bool] = True
    supports_dense_mha_prefill: bool = False
    supports_pcp: bool = False
    supports_dcp: bool = False
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = KV_LORA_RANK,
        qk_nope_head_dim: int = 0,
        qk_rope_head_dim: int = 0,
        qk_head_dim: int = 0,
        v_head_dim: int = 0,
        kv_b_proj: Any = None,
        indexer: Any = None,
        topk_indices_buffer: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                "nsa-backend sparse MLA does not support alibi_slopes, sliding_window or logits_soft_cap"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"nsa-backend sparse MLA supports decoder self-attention only, got attn_type={attn_type!r}"
            )
        if kv_lora_rank != KV_LORA_RANK:
            raise NotImplementedError(
                f"nsa-backend sparse MLA needs kv_lora_rank={KV_LORA_RANK}, got {kv_lora_rank}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_format = _kv_format(kv_cache_dtype)
        if self.kv_format == "fp8_ds_mla" and head_size != 576:
            raise NotImplementedError(f"fp8_ds_mla stores 576-dim rows; head_size is {head_size}")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        self._indexer = indexer
        self._topk_indices_buffer = topk_indices_buffer

    @property
    def topk_indices_buffer(self) -> torch.Tensor | None:
        """``[max_tokens, topk]`` int32 per-request positions chosen by the indexer (``-1``: none).

        Read through the indexer on every access: vLLM repoints a draft model's indexers at the
        target model's buffer after the layers are built.
        """
        if self._indexer is not None:
            return self._indexer.topk_indices_buffer
        return self._topk_indices_buffer

    @topk_indices_buffer.setter
    def topk_indices_buffer(self, buffer: torch.Tensor | None) -> None:
        self._indexer = None
        self._topk_indices_buffer = buffer

    # vLLM's MLA layer asks an impl whether its masked-MHA prefill fits; nsa-backend has none (the
    # metadata's ``prefill`` is ``None``, so vLLM checks neither today).
    masked_mha_available: bool = False

    @staticmethod
    def masked_mha_workspace_fits(prefill: Any) -> bool:
        """Whether a masked dense-MHA prefill fits its workspace: never, there is no such prefill."""
        return False

    def get_fp8_ds_mla_row_bytes(self) -> int:
        """Bytes of one fp8_ds_mla cache row, which vLLM (0.34 and later) sizes the cache with: the
        656-byte layout of the module docstring (the rope-free 528-byte row is not supported)."""
        return FP8_DS_MLA_BYTES

    def record_logical_topk_ready(self) -> None:
        """Called by vLLM's DSA layer once the indexer has written the top-k buffer (nothing to do)."""

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        if kv_cache.device.type == "cuda":
            # vLLM's own cache writer handles both layouts on every CUDA GPU.
            super().do_kv_cache_update(
                kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale
            )
            return
        rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).to(torch.bfloat16)
        write_kv_rows(kv_cache, rows, slot_mapping, self.kv_format, _fp8_ds_mla_scale_format())

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: NsaSparseMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = q[0] if q[1].shape[-1] == 0 else torch.cat(q, dim=-1)
        num_tokens = q.shape[0]
        buffer = self.topk_indices_buffer
        if buffer is None:
            raise RuntimeError("nsa-backend sparse MLA: the layer has no top-k index buffer")
        # Columns past index_topk (when the buffer is wider) are never written by the indexer.
        positions = buffer[:num_tokens, : attn_metadata.topk_tokens]
        return forward_sparse_mla(
            q, kv_c_and_k_pe_cache, positions, attn_metadata, self.scale, self.kv_lora_rank, self.kv_format
        ), None


def write_kv_rows(
    kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, kv_format: str, scale_format: str
) -> None:
    """Write ``rows`` ``[T, 576]`` bf16 into cache slots ``slot_mapping`` ``[T]`` (negative: skipped)."""
    if kv_format == "fp8_ds_mla":
        nsa_backend.write_fp8_ds_mla_cache(rows, kv_cache, slot_mapping, scale_format)
        return
    table, stride_rows = cache_rows(kv_cache)
    page = kv_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    table[(slots // page) * stride_rows + slots % page] = rows[keep].to(table.dtype)


def forward_sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    md: NsaSparseMLAMetadata,
    sm_scale: float,
    d_v: int,
    kv_format: str,
) -> torch.Tensor:
    """Sparse MLA of a batch over the paged cache, on the batch's core metadata (``md.core``).

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, d_qk]`` bf16 absorbed queries (latent then rope part).
    kv_cache : torch.Tensor
        ``[num_blocks, page, 656]`` uint8 (fp8_ds_mla) or ``[num_blocks, page, d_qk]`` bf16.
    positions : torch.Tensor
        ``[T, topk]`` int32 positions inside each token's request (``-1``: none), from the indexer.
    md : NsaSparseMLAMetadata
        Batch metadata; ``md.core.decode`` / ``md.core.prefill`` split the tokens.

    Returns
    -------
    torch.Tensor
        ``[T, H, d_v]`` bf16.
    """
    num_tokens = q.shape[0]
    core = md.core
    # The indexer's per-request positions become cache slots; prefill rows read them in place.
    slots = nsa_backend.logical_to_global_indices(
        positions.contiguous(), md.block_table, md.req_id_per_token[:num_tokens], core.page_size
    )
    cache = kv_cache if kv_format == "fp8_ds_mla" else kv_cache.unsqueeze(2)
    return dsa_sparse_attention(
        core, q, cache, TopkSelection(global_slots=slots, prefill_keys=None), sm_scale, kv_format=kv_format,
        d_v=d_v,
    )
