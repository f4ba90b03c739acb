"""SGLang integration of nsa-backend (import package ``nsa_backend_integrations.sglang``).

SGLang runs :func:`nsa_backend_integrations.sglang.plugin.register` through the
``sglang.srt.plugins`` entry point in every SGLang process. It registers the attention backend
``nsa_backend`` (``--attention-backend nsa_backend``): SGLang's DSA backend machinery with every
arch-bound kernel (indexer logits and schedule, top-k, sparse MLA prefill / decode, FP8 cache
writes) on nsa-backend's routed ops, so DeepSeek-V3.2 and GLM-5 run on any NVIDIA GPU and any
per-GPU head count, MTP speculative decoding included. See ``docs/sglang.md``.

Nothing here imports SGLang at package import time; :mod:`.backend` (which subclasses SGLang's
classes) is imported by the backend factories when SGLang builds a backend.
"""

from nsa_backend_integrations.sglang.plugin import BACKEND_NAME, TAKEOVER_NAMES, register

__all__ = ["BACKEND_NAME", "TAKEOVER_NAMES", "register"]
