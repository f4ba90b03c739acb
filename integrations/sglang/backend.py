"""nsa-backend's DSA attention backend for SGLang (imports SGLang; loaded by the plugin's factories).

:class:`NsaSparseAttnBackend` keeps SGLang's DSA machinery that does not depend on the GPU
(``DeepseekSparseAttnBackend``: metadata building, CUDA-graph buffers, MTP precompute) and runs
every arch-bound kernel on nsa-backend's routed ops:

- indexer logits, paged-logits metadata: SGLang's resolvers are pointed at nsa-backend
  (:mod:`nsa_backend_integrations.sglang.kernels`);
- top-k + page-table transform: :class:`NsaIndexerMetadata` (``topk_indices`` then
  ``logical_to_global_indices``), returning the same "fused" indices SGLang's kernels return;
- sparse MLA prefill / decode: :func:`nsa_backend.dsa.dsa_sparse_attention` over the metadata
  adapted by :func:`~nsa_backend_integrations.sglang.metadata.to_sparse_attn_metadata` (every
  batch, whatever its top-k layout and implementation);
- FP8 ("fp8_ds_mla", 656 B/token) cache writes: :func:`nsa_backend.write_fp8_ds_mla_cache`.

A phase whose chosen implementation is one of SGLang's own kernels (``fa3``, ``tilelang``,
``trtllm``, ...) runs SGLang's code for that phase.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
from sglang.srt.layers.attention.dsa_backend import (
    DeepseekSparseAttnBackend,
    DeepseekSparseAttnMultiStepBackend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import nsa_backend
from nsa_backend.dsa import TopkSelection, dsa_sparse_attention
from nsa_backend.routing import set_active_model
from nsa_backend.routing.validate import CHOICE_TO_IMPL
from nsa_backend_integrations.sglang import kernels
from nsa_backend_integrations.sglang.metadata import (
    field,
    mode_of_forward,
    ragged_key_slots,
    to_sparse_attn_metadata,
)
from nsa_backend_integrations.sglang.rope import apply_rope
from nsa_backend_integrations.sglang.settings import check_impl_choice, check_resolved_layout

logger = logging.getLogger("nsa_backend.sglang")

# Implementations whose sparse MLA runs on the paged cache only (FlashInfer's SM120 / trtllm-gen
# kernels): prefill batches are described one decode row per query token.
PAGED_ONLY_IMPLS: frozenset[str] = frozenset({"flashinfer"})
# Bytes per token of the scaled FP8 MLA cache (512 e4m3 + 4 fp32 scales + 64 bf16 rope).
FP8_DS_MLA_BYTES = 656


def topk_transform(
    logits: torch.Tensor,
    topk: int,
    method: TopkTransformMethod,
    attn_metadata: Any,
    *,
    lengths: torch.Tensor,
    row_starts: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    batch_idx_list: Any = None,
    topk_indices_offset: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """SGLang's fused top-k transform on nsa-backend's ops.

    Row ``i`` of ``logits`` ``[R, N]`` selects the ``topk`` best columns of
    ``[row_starts[i], row_starts[i] + lengths[i])`` (``row_starts`` defaults to 0); the local
    position ``p`` (column - row start) is returned as

    - ``RAGGED``: ``topk_indices_offset[i] + p``, a row of SGLang's ragged key buffer;
    - ``PAGED``: the cache slot of position ``p`` of the row's request, through ``page_table_1``
      (or ``real_page_table`` when the wide table was dropped).

    Returns ``[R, topk]`` int32, ``-1`` where a row has fewer keys.
    """
    rows = logits.shape[0]
    device = logits.device
    lengths = lengths.reshape(-1)[:rows].to(device=device, dtype=torch.int32)
    starts = (
        torch.zeros_like(lengths)
        if row_starts is None
        else row_starts.reshape(-1)[:rows].to(device=device, dtype=torch.int32)
    )
    cols = nsa_backend.topk_indices(logits, topk, starts, starts + lengths, impl=impl)
    none = torch.full_like(cols, -1)
    local = torch.where(cols >= 0, cols - starts[:, None], none)
    if method == TopkTransformMethod.RAGGED:
        offset = (
            topk_indices_offset
            if topk_indices_offset is not None
            else field(attn_metadata, "topk_indices_offset")
        )
        if offset is None:
            raise RuntimeError("RAGGED top-k transform needs topk_indices_offset (extend batches only)")
        offset = offset.reshape(-1)[:rows].to(device=device, dtype=torch.int32)
        return torch.where(local >= 0, local + offset[:, None], none)
    if batch_idx_list is not None:
        req_ids = torch.as_tensor(batch_idx_list, device=device).to(torch.int32).reshape(-1)[:rows]
    else:
        cu = cu_seqlens_q if cu_seqlens_q is not None else attn_metadata.cu_seqlens_q
        cu = cu.to(device=device, dtype=torch.int32)
        if cu_seqlens_q is not None:  # per-chunk lengths, not offsets
            cu = torch.cat([cu.new_zeros(1), cu.cumsum(0).to(torch.int32)])
        req_ids = torch.bucketize(torch.arange(rows, device=device, dtype=torch.int32), cu[1:], right=True)
        req_ids = req_ids.to(torch.int32)
    table = attn_metadata.page_table_1
    if table is not None:
        return nsa_backend.logical_to_global_indices(local, table.to(torch.int32), req_ids, 1, impl=impl)
    return nsa_backend.logical_to_global_indices(
        local, attn_metadata.real_page_table.to(torch.int32), req_ids, int(attn_metadata.page_size), impl=impl
    )


class NsaIndexerMetadata(DSAIndexerMetadata):
    """``DSAIndexerMetadata`` whose top-k transform runs on nsa-backend's ops."""

    topk_impl = "auto"

    def topk_transform(
        self,
        logits: torch.Tensor,
        topk: int,
        ks: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        ke_offset: torch.Tensor | None = None,
        batch_idx_list: Any = None,
        topk_indices_offset_override: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lengths = ke_offset if ke_offset is not None else self.get_seqlens_expanded()
        return topk_transform(
            logits,
            topk,
            self.topk_transform_method,
            self.attn_metadata,
            lengths=lengths,
            row_starts=ks,
            cu_seqlens_q=cu_seqlens_q,
            batch_idx_list=batch_idx_list,
            topk_indices_offset=topk_indices_offset_override,
            impl=self.topk_impl,
        )


def paged_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[num_slots, 1, dim]`` cache buffer as ``[num_blocks, page_size, 1, dim]`` (whole pages)."""
    rows = buffer.shape[0] // page_size * page_size
    return buffer[:rows].view(rows // page_size, page_size, 1, buffer.shape[-1])


def _nsa_or_sglang_forward(name: str) -> Any:
    """SGLang's ``forward_extend`` / ``forward_decode`` (``name``) on nsa-backend where the phase has an
    nsa-backend implementation and the layer passes top-k indices; SGLang's own method otherwise.

    Every argument SGLang's model code passes is honoured: ``cos_sin_cache`` / ``is_neox`` (the fused
    RoPE of ``_fuse_rope_for_trtllm_mla``: the model left ``q_rope`` / ``k_rope`` unrotated) rotate
    both with ``forward_batch.positions`` before attention and before the cache write; SGLang's own
    kernels get them unchanged."""

    def forward(
        self,
        q,
        k,
        v,
        layer,
        forward_batch,
        save_kv_cache=True,
        q_rope=None,
        k_rope=None,
        topk_indices=None,
        cos_sin_cache=None,
        is_neox=False,
        llama_4_scaling=None,
        attn_sink=None,
    ) -> torch.Tensor:
        impl = self._phase_impl(name, forward_batch)
        if impl is None or topk_indices is None:
            return getattr(super(NsaSparseAttnBackend, self), name)(
                q,
                k,
                v,
                layer,
                forward_batch,
                save_kv_cache,
                q_rope,
                k_rope,
                topk_indices,
                cos_sin_cache,
                is_neox,
                llama_4_scaling,
                attn_sink,
            )
        return self._forward_nsa(
            q,
            k,
            v,
            layer,
            forward_batch,
            save_kv_cache,
            q_rope,
            k_rope,
            topk_indices,
            attn_sink,
            impl,
            cos_sin_cache=cos_sin_cache,
            is_neox=bool(is_neox),
            llama_4_scaling=llama_4_scaling,
        )

    forward.__name__ = name
    forward.__qualname__ = f"NsaSparseAttnBackend.{name}"
    return forward


class NsaSparseAttnBackend(DeepseekSparseAttnBackend):
    """SGLang DSA attention backend running nsa-backend's routed kernels."""

    def __init__(self, model_runner, *args, **kwargs):
        super().__init__(model_runner, *args, **kwargs)
        server_args = getattr(model_runner, "server_args", None)
        self.configure(
            model_arch=model_runner.model_config.hf_config.architectures[0],
            kv_cache_dtype=str(getattr(model_runner, "kv_cache_dtype", "auto")),
            # The user's flags are the raw fields; SGLang's base class read its resolved choices
            # (get_exec().kernel) into dsa_prefill_impl / dsa_decode_impl.
            prefill_flag=getattr(server_args, "dsa_prefill_backend", None),
            decode_flag=getattr(server_args, "dsa_decode_backend", None),
            resolved=(getattr(self, "dsa_prefill_impl", None), getattr(self, "dsa_decode_impl", None)),
            disaggregation_mode=getattr(server_args, "disaggregation_mode", None),
        )

    def configure(
        self,
        *,
        model_arch: str,
        kv_cache_dtype: str,
        prefill_flag: str | None = None,
        decode_flag: str | None = None,
        device_arch: str | None = None,
        resolved: tuple[str | None, str | None] = (None, None),
        disaggregation_mode: str | None = None,
    ) -> None:
        """Check and apply the implementation choice (also usable on a bare instance).

        ``resolved``: SGLang's resolved ``(dsa_prefill_backend, dsa_decode_backend)``, which decided
        the pool's FP8 layout; ``prefill_flag`` / ``decode_flag``: the user's raw flags.
        """
        kv = "fp8_e4m3" if "float8" in kv_cache_dtype or "fp8" in kv_cache_dtype else "bfloat16"
        store_fp8 = bool(getattr(self, "dsa_kv_cache_store_fp8", False))
        if getattr(self, "dsa_index_kpool", 1) > 1:
            raise ValueError(
                "nsa-backend's SGLang backend does not support pooled index keys (index_kpool > 1)"
            )
        if getattr(self, "hisparse_coordinator", None) is not None:
            raise ValueError("nsa-backend's SGLang backend does not support --enable-hisparse")
        if getattr(self, "dcp_size", 1) > 1:
            raise ValueError("nsa-backend's SGLang backend does not support --dcp-size > 1")
        self.nsa_choices = check_impl_choice(
            model_arch, kv, prefill_flag, decode_flag, device_arch=device_arch
        )
        # SGLang's resolved kernels decide the pool layout: refuse a raw FP8 layout with the message
        # that names the flags (also run at startup, before any worker builds the backend).
        check_resolved_layout(kv, resolved, self.nsa_choices, disaggregation_mode)
        prefill_choice, decode_choice = self.nsa_choices
        ours = [
            phase
            for phase, choice in (("prefill", prefill_choice), ("decode", decode_choice))
            if CHOICE_TO_IMPL.get(choice) is not None
        ]
        kv_dim = getattr(self, "kv_cache_dim", None)
        raw_rows = not store_fp8 or (kv_dim is not None and kv_dim != FP8_DS_MLA_BYTES)
        if kv == "fp8_e4m3" and raw_rows and ours:
            # A raw pool whose resolved names check_resolved_layout accepts (e.g. SGLang's TileLang
            # pair sizes raw rows too); phases that all run SGLang's own kernels read it themselves.
            rows = f"{kv_dim} B/token" if kv_dim is not None else "no scales"
            raise ValueError(
                f"nsa-backend's SGLang backend reads the scaled fp8_ds_mla FP8 cache ({FP8_DS_MLA_BYTES} B/token) "
                f"for the {' and '.join(ours)} phase, but SGLang allocated raw FP8 MLA rows ({rows}) for its "
                f"resolved --dsa-prefill-backend {resolved[0]!r} / --dsa-decode-backend {resolved[1]!r}. "
                "Leave both --dsa-prefill-backend and --dsa-decode-backend unset, or pass --kv-cache-dtype "
                "bfloat16, or --dsa-prefill-backend flashmla_sparse --dsa-decode-backend flashmla_kv (scaled "
                "layout), or name SGLang's own kernel for both phases (e.g. --dsa-prefill-backend trtllm "
                "--dsa-decode-backend trtllm)."
            )
        # Our implementation name per phase; None: the phase runs SGLang's kernel of that name.
        self.nsa_prefill_impl = CHOICE_TO_IMPL.get(prefill_choice)
        self.nsa_decode_impl = CHOICE_TO_IMPL.get(decode_choice)
        self.dsa_prefill_impl = prefill_choice if self.nsa_prefill_impl is None else "flashmla_sparse"
        self.dsa_decode_impl = decode_choice if self.nsa_decode_impl is None else "flashmla_sparse"
        self.enable_auto_select_prefill_impl = False
        self.use_mha = False
        self.supports_mha_one_shot = False
        self.use_fused_topk = True  # indexer output = final indices (slots / ragged rows)
        self.nsa_kv_format = "fp8_ds_mla" if store_fp8 else "bf16"
        self.nsa_scale_format = "arbitrary" if model_arch.startswith("Glm") else "pow2"
        self._nsa_batch: tuple[Any, dict[Any, Any]] | None = None
        set_active_model(model_arch)
        kernels.activate_dsa()
        logger.info(
            "nsa-backend SGLang backend: prefill=%s decode=%s (%s cache)",
            prefill_choice,
            decode_choice,
            self.nsa_kv_format,
        )

    # -- SGLang hooks kept arch-independent ---------------------------------------------------

    def set_dsa_prefill_impl(self, forward_batch=None):
        self.use_mha = False

    def get_topk_transform_method(self, forward_mode=None) -> TopkTransformMethod:
        if self.nsa_prefill_impl is None:
            return super().get_topk_transform_method(forward_mode)
        if forward_mode == ForwardMode.EXTEND:
            return TopkTransformMethod.RAGGED
        return TopkTransformMethod.PAGED

    def get_indexer_metadata(self, layer_id: int, forward_batch) -> NsaIndexerMetadata:
        md = NsaIndexerMetadata(
            attn_metadata=self.forward_metadata,
            topk_transform_method=self.get_topk_transform_method(forward_batch.forward_mode),
            topk_backend=self.dsa_topk_backend,
            paged_mqa_schedule_metadata=self.forward_metadata.paged_mqa_schedule_metadata,
            paged_mqa_ctx_lens_2d=self.forward_metadata.paged_mqa_ctx_lens_2d,
            force_unfused_topk=False,
        )
        return md

    def _build_topk_v2_plan(self, seqlens_expanded):
        return None

    def _refresh_topk_v2_plan(self, metadata) -> None:
        return None

    # -- forward ------------------------------------------------------------------------------

    def _per_batch(self, key: Any, build: Any) -> Any:
        """``build()`` once per forward metadata object (prefill batches: shared by all layers)."""
        meta = self.forward_metadata
        # Compared by identity through a reference, never by ``id()``: a later batch's object may
        # reuse a freed one's address.
        if self._nsa_batch is None or self._nsa_batch[0]() is not meta:
            try:
                ref = weakref.ref(meta)
            except TypeError:
                ref = lambda: meta
            self._nsa_batch = (ref, {})
        store = self._nsa_batch[1]
        if key not in store:
            store[key] = build()
        return store[key]

    def sparse_metadata(self, forward_batch, token_rows: bool = False):
        """:class:`nsa_backend.metadata.SparseAttnMetadata` of the current batch (``token_rows``: see
        :func:`~nsa_backend_integrations.sglang.metadata.to_sparse_attn_metadata`)."""
        mode = mode_of_forward(forward_batch.forward_mode)
        slots = getattr(forward_batch, "out_cache_loc", None)

        def build():
            return to_sparse_attn_metadata(self.forward_metadata, mode, slots, token_rows=token_rows)

        if mode == "prefill":
            return self._per_batch(("metadata", token_rows), build)
        return build()

    def _selection(self, md, indices: torch.Tensor, ragged: bool) -> TopkSelection:
        """The layer's top-k indices as cache slots (and prefill key-buffer rows where ``md`` has them)."""
        if not ragged:  # cache slots already
            return TopkSelection(global_slots=indices, prefill_keys=None)
        # Rows of SGLang's ragged key buffer (the keys of every request in order).
        if md.prefill is not None:
            key_slots = md.prefill.key_slots
        else:
            key_slots = self._per_batch("ragged_key_slots", lambda: ragged_key_slots(self.forward_metadata))
        valid = indices >= 0
        slots = key_slots[indices.clamp(min=0).long()].to(torch.int32)
        global_slots = torch.where(valid, slots, torch.full_like(slots, -1))
        prefill_keys = indices if md.prefill is not None else None
        return TopkSelection(global_slots=global_slots, prefill_keys=prefill_keys)

    def _cache_bytes(self, layer) -> torch.Tensor:
        """The layer's fp8_ds_mla cache as ``uint8 [num_slots, 1, 656]``."""
        return self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(torch.uint8)

    def _write_kv(self, layer, loc: torch.Tensor, k: torch.Tensor, k_rope: torch.Tensor | None) -> None:
        if self.nsa_kv_format != "fp8_ds_mla":
            self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)
            return
        num = loc.shape[0]
        parts = [k.reshape(num, -1)]
        if k_rope is not None:
            parts.append(k_rope.reshape(num, -1))
        kv = torch.cat(parts, dim=-1).to(torch.bfloat16)
        nsa_backend.write_fp8_ds_mla_cache(kv, self._cache_bytes(layer), loc, self.nsa_scale_format)

    def _attention_cache(self, layer, page_size: int) -> torch.Tensor:
        if self.nsa_kv_format == "fp8_ds_mla":
            return paged_view(self._cache_bytes(layer), page_size)
        return paged_view(self.token_to_kv_pool.get_key_buffer(layer.layer_id), page_size)

    def _forward_nsa(
        self,
        q,
        k,
        v,
        layer,
        forward_batch,
        save_kv_cache,
        q_rope,
        k_rope,
        topk_indices,
        attn_sink,
        impl: str,
        *,
        cos_sin_cache: torch.Tensor | None = None,
        is_neox: bool = False,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if llama_4_scaling is not None:
            raise ValueError(
                "llama_4_scaling: nsa-backend's SGLang backend serves DSA models, which have no Llama-4 "
                "query scaling; got a tensor"
            )
        if cos_sin_cache is not None:
            q_rope, k_rope = self._fused_rope(forward_batch, q_rope, k_rope, cos_sin_cache, is_neox)
        if k is not None and save_kv_cache:
            self._write_kv(layer, forward_batch.out_cache_loc, k, k_rope)
        heads = layer.tp_q_head_num
        if q_rope is not None:
            q_nope = q.view(-1, heads, layer.v_head_dim)
            q_all = torch.cat([q_nope, q_rope.view(q_nope.shape[0], heads, -1)], dim=-1)
        else:
            q_all = q.contiguous().view(-1, heads, layer.head_dim)
        q_all = q_all.to(torch.bfloat16)
        total = q_all.shape[0]
        ragged = self.get_topk_transform_method(forward_batch.forward_mode) == TopkTransformMethod.RAGGED
        # Only ragged top-k rows on a kernel with a ragged prefill entry use the gathered key
        # buffer; every other batch that is not an even decode / verify batch (paged top-k of a
        # mixed chunk or an uneven draft extend, paged-cache-only kernels) runs one decode row per
        # query token on the paged cache.
        token_rows = not ragged or impl in PAGED_ONLY_IMPLS
        md = self.sparse_metadata(forward_batch, token_rows)
        n = md.num_tokens
        selection = self._selection(md, topk_indices[:n].to(torch.int32), ragged)
        out = dsa_sparse_attention(
            md,
            q_all[:n],
            self._attention_cache(layer, md.page_size),
            selection,
            layer.scaling,
            kv_format=self.nsa_kv_format,
            d_v=layer.v_head_dim,
            attn_sink=attn_sink,
            # the scale format of this backend's own cache writes (_write_kv)
            kv_scale_format=self.nsa_scale_format if self.nsa_kv_format == "fp8_ds_mla" else None,
            impl=impl,
        )
        if total > n:  # DP / graph padding rows
            out = torch.cat([out, out.new_zeros(total - n, *out.shape[1:])])
        return out

    def _fused_rope(self, forward_batch, q_rope, k_rope, cos_sin_cache: torch.Tensor, is_neox: bool):
        """RoPE the model left to the backend (SGLang's fused path), on ``forward_batch.positions``."""
        if q_rope is None or k_rope is None:
            raise ValueError(
                "cos_sin_cache: given without q_rope / k_rope; nsa-backend applies the fused RoPE to the "
                "separate rope parts SGLang's DeepSeek MLA forward passes"
            )
        if getattr(forward_batch, "attn_cp_metadata", None) is not None:
            raise ValueError(
                "cos_sin_cache: fused RoPE of a context-parallel prefill shard is not supported "
                "(nsa-backend refuses --enable-prefill-cp at startup)"
            )
        positions = forward_batch.positions
        return (
            apply_rope(q_rope, positions, cos_sin_cache, is_neox),
            apply_rope(k_rope, positions, cos_sin_cache, is_neox),
        )

    def _phase_impl(self, name: str, forward_batch) -> str | None:
        """nsa-backend implementation for SGLang's ``forward_extend`` / ``forward_decode`` of this
        batch (speculative verify and draft-extend batches are decode work), None for SGLang's own."""
        if name == "forward_decode":
            return self.nsa_decode_impl
        mode = forward_batch.forward_mode
        speculative = mode.is_target_verify() or mode.is_draft_extend_v2()
        return self.nsa_decode_impl if speculative else self.nsa_prefill_impl

    forward_extend = _nsa_or_sglang_forward("forward_extend")
    forward_decode = _nsa_or_sglang_forward("forward_decode")


class NsaSparseAttnMultiStepBackend(DeepseekSparseAttnMultiStepBackend):
    """Multi-step MTP / EAGLE draft decode backend built from :class:`NsaSparseAttnBackend` steps."""

    def __init__(
        self,
        model_runner,
        topk: int,
        speculative_num_steps: int,
        seed_dsa_topk_from_draft_extend: bool = False,
    ):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self._sink_pad_cache = {}
        self.attn_backends = [
            NsaSparseAttnBackend(
                model_runner,
                speculative_step_id=i,
                topk=topk,
                speculative_num_steps=speculative_num_steps,
                seed_dsa_topk_from_draft_extend=seed_dsa_topk_from_draft_extend,
            )
            for i in range(speculative_num_steps - 1)
        ]
