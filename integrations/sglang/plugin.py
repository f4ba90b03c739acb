"""The ``sglang.srt.plugins`` entry point of nsa-backend.

SGLang's ``load_plugins()`` calls :func:`register` in the launching process (before the server
arguments are parsed) and again in every scheduler / TP worker, so registration is idempotent and
cheap. This module imports nothing from SGLang until :func:`register` runs; without SGLang,
:func:`register` raises ``RuntimeError``.

What :func:`register` installs:

- ``nsa_backend`` in SGLang's attention-backend registry, the ``--attention-backend`` choices,
  the MLA backend lists of the DeepSeek model code (absorbed MLA, DSA dispatch) and the
  speculative-decoding draft backend factory (MTP / EAGLE draft extend and multi-step decode);
- an extra check after SGLang's own ``ServerArgs.check_server_args`` that validates the prefill /
  decode implementation choice with :func:`nsa_backend.routing.validate_impl_choice`;
- with ``takeover`` (``[sglang]`` config table or ``NSA_BACKEND_SGLANG_TAKEOVER=1``): the same
  backend under SGLang's ``dsa`` and ``nsa`` names, and DeepGEMM's indexer / mHC functions routed
  to nsa-backend for the DeepSeek-V4 ``dsv4`` backend.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from nsa_backend_integrations.sglang.settings import SglangSettings, check_impl_choice, load_settings

logger = logging.getLogger("nsa_backend.sglang")

BACKEND_NAME = "nsa_backend"
"""The ``--attention-backend`` value that selects nsa-backend."""
TAKEOVER_NAMES: tuple[str, ...] = ("dsa", "nsa")
"""SGLang's built-in DSA backend names served by nsa-backend under ``takeover``."""

_MARK = "__nsa_backend_hook__"
_lock = threading.RLock()
_registered = False
_served: tuple[str, ...] = ()
_settings: SglangSettings | None = None


def served_names() -> tuple[str, ...]:
    """Backend names this process serves with nsa-backend (empty before :func:`register`)."""
    return _served


def is_registered() -> bool:
    return _registered


def register() -> None:
    """Register nsa-backend with SGLang (the ``sglang.srt.plugins`` entry point; idempotent)."""
    global _registered, _served, _settings
    with _lock:
        if _registered:
            return
        try:
            import sglang.srt.layers.attention.attention_registry  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                f"nsa-backend's SGLang plugin was called but SGLang cannot be imported: {exc}. "
                "Install it with: pip install 'nsa-backend[sglang]'"
            ) from exc
        try:
            settings = load_settings()
            names = (BACKEND_NAME, *(TAKEOVER_NAMES if settings.takeover else ()))
            _register_attention_backends(names)
            _register_cli_choices()
            _register_mla()
            _patch_draft_backend_factory()
            _patch_check_server_args()
            if settings.takeover:
                from nsa_backend_integrations.sglang import kernels

                kernels.activate_deep_gemm()
        except Exception:
            # SGLang's loader only logs a failing plugin; say it in our logger too.
            logger.exception("nsa-backend: registering the SGLang plugin failed")
            raise
        _settings, _served, _registered = settings, names, True
    logger.info("nsa-backend: SGLang attention backend registered as %s", ", ".join(names))


# -- backend factories (SGLang calls them with the model runner) ------------------------------


def create_backend(runner):
    """``ATTENTION_BACKENDS`` factory: nsa-backend's DSA backend for ``runner``."""
    from nsa_backend_integrations.sglang.backend import NsaSparseAttnBackend

    return NsaSparseAttnBackend(runner)


def create_draft_extend_backend(runner, seed_dsa_topk_from_draft_extend: bool = False):
    from nsa_backend_integrations.sglang.backend import NsaSparseAttnBackend

    return NsaSparseAttnBackend(
        runner, skip_prefill=False, seed_dsa_topk_from_draft_extend=seed_dsa_topk_from_draft_extend
    )


def create_draft_decode_backend(
    runner, topk: int, speculative_num_steps: int, seed_dsa_topk_from_draft_extend: bool = False
):
    from nsa_backend_integrations.sglang.backend import NsaSparseAttnMultiStepBackend

    return NsaSparseAttnMultiStepBackend(
        runner, topk, speculative_num_steps, seed_dsa_topk_from_draft_extend=seed_dsa_topk_from_draft_extend
    )


# -- registration steps --------------------------------------------------------------------------


def _register_attention_backends(names: tuple[str, ...]) -> None:
    from sglang.srt.layers.attention import attention_registry

    for name in names:
        if attention_registry.ATTENTION_BACKENDS.get(name) is not create_backend:
            attention_registry.ATTENTION_BACKENDS[name] = create_backend


def _register_cli_choices() -> None:
    from sglang.srt.arg_groups import choices

    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])


def _register_mla() -> None:
    """Make the DeepSeek model code treat our name as an absorbed-MLA DSA backend."""
    from sglang.srt.models.deepseek_common import attention_backend_handler, utils

    absorb = utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    if BACKEND_NAME not in absorb:
        absorb.append(BACKEND_NAME)
    registry = attention_backend_handler.AttentionBackendRegistry
    handler = attention_backend_handler.handle_attention_dsa
    if registry.get_handler(BACKEND_NAME) is not handler:
        registry.register(BACKEND_NAME, handler)
    # Releases that keep an explicit MLA capability list in the model runner.
    try:
        from sglang.srt.model_executor import model_runner
    except ImportError:  # pragma: no cover - depends on the SGLang release
        return
    add_mla = getattr(model_runner, "add_mla_attention_backend", None)
    if add_mla is not None:
        mla_list = getattr(model_runner, "MLA_ATTENTION_BACKENDS", None)
        if mla_list is None or BACKEND_NAME not in mla_list:
            add_mla(BACKEND_NAME)


def _patch_draft_backend_factory() -> None:
    """Teach ``DraftBackendFactory`` (MTP / EAGLE) to build nsa-backend's backends."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    original = DraftBackendFactory._create_backend
    if getattr(original, _MARK, False):
        return

    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        entries = {}
        for name in served_names():
            if stamps_children:
                entries[name] = lambda name=name: (
                    name,
                    create_draft_decode_backend(
                        self.draft_model_runner,
                        self.topk,
                        self.speculative_num_steps,
                        seed_dsa_topk_from_draft_extend=self.seed_dsa_topk_from_draft_extend,
                    ),
                )
            else:
                entries[name] = lambda name=name: (
                    name,
                    create_draft_extend_backend(
                        self.draft_model_runner,
                        seed_dsa_topk_from_draft_extend=self.seed_dsa_topk_from_draft_extend,
                    ),
                )
        return original(self, backend_name, {**backend_map, **entries}, error_template, stamps_children)

    setattr(_create_backend, _MARK, True)
    _create_backend.__wrapped__ = original
    DraftBackendFactory._create_backend = _create_backend


def _patch_check_server_args() -> None:
    """Run :func:`validate_server_args` after SGLang's own server-argument checks."""
    from sglang.srt.server_args import ServerArgs

    original = ServerArgs.check_server_args
    if getattr(original, _MARK, False):
        return

    def check_server_args(self):
        check_server_args.__wrapped__(self)
        validate_server_args(self)

    setattr(check_server_args, _MARK, True)
    check_server_args.__wrapped__ = original
    ServerArgs.check_server_args = check_server_args


# -- startup validation --------------------------------------------------------------------------


def _hf_config(server_args: Any) -> dict:
    """The model's HF config as a dict (SGLang's model config, else ``<model_path>/config.json``)."""
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        hf = model_config_of(server_args).hf_config
        return hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    except Exception as exc:
        path = os.path.join(str(getattr(server_args, "model_path", "")), "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"nsa-backend: cannot read the model config of {server_args.model_path!r}: {exc}"
            ) from exc
        with open(path) as f:
            return json.load(f)


def validate_server_args(server_args: Any) -> tuple[str, str] | None:
    """Validate the implementation choice when an nsa-backend name is the attention backend.

    Returns ``(prefill_choice, decode_choice)``, or ``None`` when nsa-backend is not selected.
    Raises :class:`nsa_backend.routing.ImplChoiceError` with the validator's message.
    """
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

    view = resolved_view(server_args)
    served = served_names() or (BACKEND_NAME,)
    if not any(name in served for name in attention_backends_of(view)):
        return None
    hf = _hf_config(server_args)
    archs = hf.get("architectures") or ["?"]
    kv = str(getattr(view, "kv_cache_dtype", "auto") or "auto")
    choice = check_impl_choice(
        archs[0],
        kv,
        getattr(server_args, "dsa_prefill_backend", None),
        getattr(server_args, "dsa_decode_backend", None),
    )
    logger.info("nsa-backend: %s prefill=%s decode=%s accepted", archs[0], *choice)
    return choice
