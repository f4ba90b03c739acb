"""vLLM's ``SparseAttnIndexer`` custom op on nsa-backend (imports vLLM; loaded by ``plugin.register``).

:class:`NsaSparseAttnIndexer` is registered out of tree under vLLM's op name, so every model that
builds a ``SparseAttnIndexer`` gets this class. Where it is enabled (``indexer`` setting; by default
on every GPU without DeepGEMM indexer kernels, i.e. other than SM90/SM100) it

- never requires DeepGEMM (vLLM's constructor refuses to build without it on CUDA);
- computes the top-k with :func:`nsa_backend.fp8_mqa_logits` (prefill),
  :func:`nsa_backend.fp8_paged_mqa_logits` (decode) and :func:`nsa_backend.topk_indices`, through
  the torch op ``vllm::nsa_sparse_attn_indexer`` (a piecewise-CUDA-graph splitting op, like
  vLLM's own ``vllm::sparse_attn_indexer``);
- points the two module-level names vLLM's DSA code calls directly at nsa-backend:
  ``vllm.models.deepseek_v32.attention.sparse_attn_indexer`` (the fused DeepSeek-V3.2 / GLM-5
  layer calls the indexer function itself) and the DeepGEMM ``get_paged_mqa_logits_metadata``
  used by vLLM's indexer metadata builder.

Where it is disabled the class behaves exactly like vLLM's op.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.utils.torch_utils import direct_register_custom_op

import nsa_backend
from nsa_backend_integrations.vllm.config import announce_model, deep_gemm_has_kernels, deep_gemm_serves_indexer
from nsa_backend_integrations.vllm.indexer_ops import check_logits_dtype, run_indexer

logger = logging.getLogger("nsa_backend.vllm")

OP_NAME = "nsa_sparse_attn_indexer"
SPLITTING_OP = f"vllm::{OP_NAME}"
_V32_ATTENTION_MODULE = "vllm.models.deepseek_v32.attention"
_INDEXER_BACKEND_MODULE = "vllm.v1.attention.backends.mla.indexer"

_mode = "auto"
_warned: set[str] = set()


def set_mode(mode: str) -> None:
    """``"on"``: always nsa-backend; ``"auto"``: only where DeepGEMM has no indexer kernel."""
    global _mode
    _mode = mode


def enabled_for_current_device(num_heads: int | None = None, head_dim: int = 128, page_size: int = 64) -> bool:
    """Whether an indexer built now runs on nsa-backend (``indexer`` setting and this process's GPU).

    ``auto``: where the DeepGEMM vLLM loads does not serve a layer of ``num_heads`` index heads of
    ``head_dim`` over ``page_size``-token blocks on this GPU (``num_heads=None``: where it has no
    indexer kernel for the GPU at all).
    """
    if _mode == "on":
        return True
    if _mode == "off":
        return False
    from nsa_backend.routing import detect_arch

    arch = detect_arch()
    if num_heads is None:
        return not deep_gemm_has_kernels(arch)
    served, why = deep_gemm_serves_indexer(arch, int(num_heads), int(head_dim), int(page_size))
    logger.debug("nsa-backend indexer, %d heads on %s: %s (%s)", num_heads, arch,
                 "vLLM's DeepGEMM" if served else "nsa-backend", why)
    return not served


def _layer_index_heads() -> int | None:
    """Index heads of the model being built (``index_n_heads``; vLLM replicates the indexer on
    every rank), ``None`` outside a model config."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    hf_config = getattr(getattr(config, "model_config", None), "hf_text_config", None)
    heads = getattr(hf_config, "index_n_heads", None)
    return int(heads) if heads else None


def _mx_scaled_k_cache() -> bool:
    """Whether vLLM writes the indexer K scales as packed UE8M0 bytes (SM100) instead of fp32."""
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
    except ImportError:
        return False
    return bool(mqa_logits_use_mx_scales())


def _layer_name(prefix: Any) -> str:
    return getattr(prefix, "value", prefix)


def _reserve_profile_memory(hidden_states: torch.Tensor, total_seq_lens: int, head_dim: int) -> None:
    """Peak working memory of a real step, allocated once during vLLM's memory profiling run."""
    import vllm.envs as vllm_envs

    logits_bytes = int(getattr(vllm_envs, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", 512)) * 1024 * 1024
    keys_bytes = int(total_seq_lens) * (head_dim + 4)
    torch.empty(logits_bytes + keys_bytes, dtype=torch.uint8, device=hidden_states.device)


def nsa_sparse_attn_indexer(
    hidden_states: torch.Tensor,
    k_cache_prefix: Any,
    kv_cache: torch.Tensor,
    q_quant: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    quant_block_size: int,
    scale_fmt: str | None,
    topk_tokens: int,
    head_dim: int,
    max_model_len: int,
    total_seq_lens: int,
    topk_indices_buffer: torch.Tensor,
    skip_k_cache_insert: bool = False,
    use_pcp: bool = False,
    pcp_shard_decode_requests: bool = False,
    dense_mha_metadata_layer_name: Any = "",
    use_fp4_cache: bool = False,
    dcp_rank: int = 0,
    dcp_world_size: int = 1,
    cp_kv_cache_interleave_size: int = 1,
    skip_topk_buffer_clear: bool = False,
    candidate_blocks: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    candidate_write: bool = False,
    topk_backend: str = "auto",
    logits_dtype: torch.dtype = torch.float32,
    dcp_direct_topk_max_rows: int = 0,
) -> torch.Tensor:
    """Drop-in for vLLM's ``sparse_attn_indexer`` function on nsa-backend ops.

    The parameters are those of vLLM 0.34's function, a superset of 0.33's (which lacks
    ``logits_dtype`` and ``dcp_direct_topk_max_rows``). Reads the layer's
    ``DeepseekV32IndexerMetadata`` from vLLM's forward context, writes the indexer keys of this
    step (unless ``skip_k_cache_insert``) and fills ``topk_indices_buffer`` rows ``[0, T)`` with
    per-request positions.

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[T_padded, hidden]``; only its row count is read (rows cleared in the buffer).
    q_quant : torch.Tensor
        ``[T, H, D]`` e4m3 index queries, the q scale folded into ``weights``.
    k : torch.Tensor, optional
        ``[T, D]`` index keys of this step (needed unless ``skip_k_cache_insert``).
    weights : torch.Tensor
        ``[T, H]`` per-head weights.
    topk_indices_buffer : torch.Tensor
        ``[max_tokens, >= topk_tokens]`` int32, written in place.
    skip_k_cache_insert, skip_topk_buffer_clear, dense_mha_metadata_layer_name
        Honoured as in vLLM (the fused layer writes the keys and clears the rows itself; a batch
        that the attention layer serves by dense MHA gets no top-k).
    logits_dtype : torch.dtype
        Dtype the index scores are produced in before the top-k: ``torch.float32`` or
        ``torch.bfloat16`` (``ValueError`` naming the value otherwise).
    use_fp4_cache, q_scale, use_pcp, dcp_world_size > 1, candidate_blocks
        Not supported: ``NotImplementedError`` (such layers keep vLLM's indexer).
    topk_backend, dcp_direct_topk_max_rows, dcp_rank, cp_kv_cache_interleave_size
        Accepted and ignored (see below).
    pcp_shard_decode_requests, candidate_block_size, candidate_write, total_seq_lens
        Accepted and ignored: they pick a vLLM-internal top-k kernel or only take effect with
        context parallelism or candidate blocks, which are refused above (``total_seq_lens`` sizes
        the profiling run's reservation).

    Returns
    -------
    torch.Tensor
        ``topk_indices_buffer``.
    """
    check_logits_dtype(logits_dtype)
    unsupported = [
        name
        for name, used in (
            ("FP4 indexer cache", use_fp4_cache or q_scale is not None),
            ("decode context parallelism", dcp_world_size > 1),
            ("prefill context parallelism", use_pcp),
            ("two-level candidate selection", candidate_blocks is not None),
        )
        if used
    ]
    if unsupported:
        raise NotImplementedError(
            f"nsa-backend indexer does not support {', '.join(unsupported)}; set "
            "NSA_BACKEND_VLLM_INDEXER=off to use vLLM's indexer"
        )
    if quant_block_size != head_dim:
        raise NotImplementedError(
            f"nsa-backend indexer needs one K scale per token (quant_block_size = head_dim "
            f"= {head_dim}), got quant_block_size={quant_block_size}"
        )
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if not isinstance(attn_metadata, dict):
        # vLLM's memory profiling run: no batch, reserve the working memory of a real one.
        _reserve_profile_memory(hidden_states, total_seq_lens, head_dim)
        return topk_indices_buffer
    metadata = attn_metadata[_layer_name(k_cache_prefix)]
    dense_layer = _layer_name(dense_mha_metadata_layer_name)
    if dense_layer and not torch.cuda.is_current_stream_capturing():
        mla_metadata = attn_metadata.get(dense_layer)
        prefill = getattr(mla_metadata, "prefill", None)
        if getattr(prefill, "use_dense_mha", False) and getattr(mla_metadata, "num_decode_tokens", -1) == 0:
            # The attention layer runs dense MHA for this batch and reads no top-k indices.
            return topk_indices_buffer
    if not skip_topk_buffer_clear:
        topk_indices_buffer[: hidden_states.shape[0]] = -1  # CUDA-graph padding rows included
    num_tokens = metadata.slot_mapping.shape[0]
    return run_indexer(
        metadata,
        kv_cache,
        q_quant[:num_tokens],
        k,
        weights,
        scale_fmt=scale_fmt,
        topk_tokens=topk_tokens,
        head_dim=head_dim,
        max_model_len=max_model_len,
        topk_indices_buffer=topk_indices_buffer,
        insert_k=not skip_k_cache_insert,
        clear_buffer=False,
        logits_dtype=logits_dtype,
    )


def _indexer_op(
    hidden_states: torch.Tensor,
    k_cache_prefix: str,
    kv_cache: torch.Tensor,
    q_quant: torch.Tensor,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    quant_block_size: int,
    scale_fmt: str | None,
    topk_tokens: int,
    head_dim: int,
    max_model_len: int,
    total_seq_lens: int,
    topk_indices_buffer: torch.Tensor,
    skip_k_cache_insert: bool,
    skip_topk_buffer_clear: bool,
    logits_dtype: torch.dtype,
) -> None:
    nsa_sparse_attn_indexer(
        hidden_states,
        k_cache_prefix,
        kv_cache,
        q_quant,
        None,
        k,
        weights,
        quant_block_size,
        scale_fmt,
        topk_tokens,
        head_dim,
        max_model_len,
        total_seq_lens,
        topk_indices_buffer,
        skip_k_cache_insert,
        skip_topk_buffer_clear=skip_topk_buffer_clear,
        logits_dtype=logits_dtype,
    )


def _indexer_op_fake(*args: Any, **kwargs: Any) -> None:
    """Tracing stand-in for :func:`_indexer_op`: the op returns nothing and only writes into
    ``topk_indices_buffer``."""
    return None


def register_torch_op() -> None:
    """Register ``torch.ops.vllm.nsa_sparse_attn_indexer`` as a CUDA-graph splitting op (idempotent)."""
    if not hasattr(torch.ops.vllm, OP_NAME):
        direct_register_custom_op(
            op_name=OP_NAME,
            op_func=_wrap_for_capture(_indexer_op),
            mutates_args=["topk_indices_buffer"],
            fake_impl=_indexer_op_fake,
        )
    from vllm.config.compilation import CompilationConfig

    attention_ops = getattr(CompilationConfig, "_attention_ops", None)
    if isinstance(attention_ops, list) and SPLITTING_OP not in attention_ops:
        attention_ops.append(SPLITTING_OP)


def _paged_mqa_logits_metadata(
    context_lens: torch.Tensor, block_size: int, num_sms: int, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """vLLM's indexer builder calls DeepGEMM's schedule function; nsa-backend's routed one replaces it.

    Same parameters as ``vllm.utils.deep_gemm.get_paged_mqa_logits_metadata``. ``context_lens`` is
    ``[B, next_n]`` (or ``[B]``) int32; the schedule splits those rows' keys over ``num_sms`` workers
    and is read only by nsa-backend's paged logits. ``indices`` (the request of each row where
    vLLM expands decode rows one per token) is ignored: the rows are already one per token and the
    schedule depends only on their context lengths.
    """
    return nsa_backend.get_paged_mqa_logits_metadata(
        context_lens.to(torch.int32).contiguous(), int(block_size), int(num_sms)
    )


def _wrap_for_capture(fn: Any) -> Any:
    """``fn`` run eagerly between CUDA-graph segments during vLLM's (breakable) graph capture and
    replayed from Python, as vLLM's own indexer function is; ``fn`` itself without that support."""
    try:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    except ImportError:
        return fn
    return eager_break_during_capture(fn)


_patched: dict[str, Any] = {}


def install_module_patches() -> dict[str, Any]:
    """Point the indexer entry points that vLLM's DSA code calls by module-level name at nsa-backend.

    Idempotent; a module not imported yet is patched by a later call (every enabled indexer
    calls this when it is built, after its model module is imported). Returns what is patched.
    """
    module = sys.modules.get(_V32_ATTENTION_MODULE)
    if module is not None and getattr(module, "sparse_attn_indexer", None) is not _patched.get(
        _V32_ATTENTION_MODULE
    ):
        if hasattr(module, "sparse_attn_indexer"):
            wrapped = _wrap_for_capture(nsa_sparse_attn_indexer)
            module.sparse_attn_indexer = wrapped
            _patched[_V32_ATTENTION_MODULE] = wrapped
            logger.info("nsa-backend: DeepSeek-V3.2 / GLM-5 DSA layers use the nsa-backend indexer")
    module = sys.modules.get(_INDEXER_BACKEND_MODULE)
    if (
        module is not None
        and hasattr(module, "get_paged_mqa_logits_metadata")
        and module.get_paged_mqa_logits_metadata is not _paged_mqa_logits_metadata
    ):
        module.get_paged_mqa_logits_metadata = _paged_mqa_logits_metadata
        _patched[_INDEXER_BACKEND_MODULE] = _paged_mqa_logits_metadata
    return dict(_patched)


def _nsa_or_vllm_forward(name: str) -> Any:
    """``SparseAttnIndexer.<name>`` that runs :meth:`NsaSparseAttnIndexer._nsa_forward` where the
    layer is enabled and vLLM's method of that name otherwise.

    It has the signature of vLLM's method (that of ``forward_native`` where vLLM's takes only
    ``*args, **kwargs``), parameter names included, so a call by keyword reaches the same argument.
    """
    vllm_method = getattr(SparseAttnIndexer, name)
    signature = inspect.signature(vllm_method)
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in list(signature.parameters.values())[1:]):
        signature = inspect.signature(SparseAttnIndexer.forward_native)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.nsa_enabled:
            # (hidden_states, q_quant, k, weights), whatever vLLM names them.
            hidden_states, q_quant, k, weights = list(signature.bind(self, *args, **kwargs).arguments.values())[1:5]
            return self._nsa_forward(hidden_states, q_quant, k, weights)
        return getattr(super(NsaSparseAttnIndexer, self), name)(*args, **kwargs)

    forward.__name__ = name
    forward.__qualname__ = f"NsaSparseAttnIndexer.{name}"
    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward


class NsaSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's indexer op with nsa-backend kernels (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except RuntimeError as exc:
            # vLLM refuses to build its CUDA op without DeepGEMM, after storing the layer's fields.
            if "DeepGEMM" not in str(exc) or not enabled_for_current_device():
                raise
        self.nsa_enabled = enabled_for_current_device(_layer_index_heads(), self.head_dim)
        unsupported = [
            name
            for name, used in (
                ("an FP4 K cache", getattr(self, "use_fp4_cache", False)),
                ("a compressed K cache", getattr(self, "compress_ratio", 1) != 1),
                ("candidate blocks", getattr(self, "candidate_blocks", None) is not None),
                ("decode context parallelism", getattr(self, "dcp_world_size", 1) > 1),
                ("prefill context parallelism", getattr(self, "use_pcp", False)),
                ("MX-scaled K cache rows (SM100)", _mx_scaled_k_cache()),
            )
            if used
        ]
        if self.nsa_enabled and unsupported:
            reason = ", ".join(unsupported)
            if reason not in _warned:
                _warned.add(reason)
                logger.warning("nsa-backend indexer: layers with %s keep vLLM's indexer", reason)
            self.nsa_enabled = False
        if self.nsa_enabled:
            from vllm.config import get_current_vllm_config_or_none

            announce_model(get_current_vllm_config_or_none())
            register_torch_op()
            install_module_patches()

    def _nsa_forward(
        self, hidden_states: torch.Tensor, q_quant: Any, k: torch.Tensor | None, weights: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(q_quant, tuple):
            raise NotImplementedError("nsa-backend indexer: FP4 index queries are not supported")
        torch.ops.vllm.nsa_sparse_attn_indexer(
            hidden_states,
            str(_layer_name(self.k_cache.prefix)),
            self.k_cache.kv_cache,
            q_quant,
            k,
            weights,
            self.quant_block_size,
            self.scale_fmt,
            self.topk_tokens,
            self.head_dim,
            self.max_model_len,
            self.max_total_seq_len,
            self.topk_indices_buffer,
            self.skip_k_cache_insert,
            bool(getattr(self, "skip_topk_buffer_clear", False)),
            getattr(self, "logits_dtype", torch.float32),
        )
        return self.topk_indices_buffer

    # Every platform's forward: nsa-backend where this layer is enabled, vLLM's own otherwise.
    forward_native = _nsa_or_vllm_forward("forward_native")
    forward_cuda = _nsa_or_vllm_forward("forward_cuda")
    forward_hip = _nsa_or_vllm_forward("forward_hip")
    forward_xpu = _nsa_or_vllm_forward("forward_xpu")
    forward_cpu = _nsa_or_vllm_forward("forward_cpu")
    forward_oot = _nsa_or_vllm_forward("forward_oot")


def register_oot_indexer(mode: str) -> type[SparseAttnIndexer]:
    """Register :class:`NsaSparseAttnIndexer` as vLLM's out-of-tree ``SparseAttnIndexer`` (idempotent)."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    set_mode(mode)
    current = op_registry_oot.get("SparseAttnIndexer")
    if current is None:
        CustomOp.register_oot(NsaSparseAttnIndexer, name="SparseAttnIndexer")
    elif current is not NsaSparseAttnIndexer:
        raise RuntimeError(
            f"vLLM's SparseAttnIndexer is already replaced by {current.__module__}.{current.__qualname__}"
        )
    return NsaSparseAttnIndexer
