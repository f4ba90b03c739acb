"""vLLM integration of nsa-backend (import package ``nsa_backend_integrations.vllm``).

vLLM loads :func:`nsa_backend_integrations.vllm.plugin.register` through the
``vllm.general_plugins`` entry point in every vLLM process. It

- registers :class:`~nsa_backend_integrations.vllm.backend.NsaSparseMLABackend` as
  ``AttentionBackendEnum.CUSTOM`` (``vllm serve ... --attention-backend CUSTOM``) and, when the
  ``takeover`` setting asks for it, in place of ``FLASHMLA_SPARSE`` /
  ``FLASHINFER_MLA_SPARSE_SM120``;
- replaces vLLM's ``SparseAttnIndexer`` custom op with one that runs nsa-backend's routed indexer
  and top-k ops (no DeepGEMM needed);
- routes vLLM's DeepGEMM ``tf32_hc_prenorm_gemm`` (DeepSeek-V4 mHC) and the indexer's
  ``get_paged_mqa_logits_metadata`` to nsa-backend on GPUs where DeepGEMM has no kernel.

Nothing here imports vLLM at package import time; the modules that subclass vLLM classes
(``backend``, ``indexer``) are imported by vLLM itself or by :func:`plugin.register`.
See ``docs/vllm.md`` for the settings and the ``vllm serve`` commands.
"""

from nsa_backend_integrations.vllm.plugin import register

__all__ = ["register"]
