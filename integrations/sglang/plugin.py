"""The ``sglang.srt.plugins`` entry point of nsa-backend.

SGLang's ``load_plugins()`` calls :func:`register` in the launching process (before the server
arguments are parsed) and again in every scheduler / TP worker, so registration is idempotent and
cheap. This module imports nothing from SGLang until :func:`register` runs; without SGLang,
:func:`register` raises ``RuntimeError``.

What :func:`register` installs:

- ``nsa_backend`` in SGLang's attention-backend registry, the ``--attention-backend`` choices,
  the MLA backend lists of the DeepSeek model code (absorbed MLA, DSA dispatch) and the
  speculative-decoding draft backend factory (MTP / EAGLE draft extend and multi-step decode);
- a wrapper of SGLang's ``handle_model_specific_adjustments`` resolution step (where SGLang picks the
  FP8 cache and the per-phase DSA kernels): when nsa-backend serves a phase and SGLang picked TRT-LLM's
  raw FP8 cache layout by itself, the phases are resolved to kernels of the scaled ``fp8_ds_mla``
  layout nsa-backend's ops read (:func:`resolve_scaled_fp8_layout`);
- an extra check after SGLang's own ``ServerArgs.check_server_args`` that validates the prefill /
  decode implementation choice with :func:`nsa_backend.routing.validate_impl_choice`;
- with ``takeover`` (``[sglang]`` config table or ``NSA_BACKEND_SGLANG_TAKEOVER=1``): the same
  backend under SGLang's ``dsa`` and ``nsa`` names, and the DeepSeek-V4 ``dsv4`` backend's kernels
  routed per call (:func:`_activate_dsv4`): DeepGEMM's indexer / mHC functions, and its sparse
  decode / prefill / KV-cache write where no native kernel serves the GPU and shape
  (:mod:`nsa_backend_integrations.sglang.dsv4`). ``--attention-backend nsa_backend`` with a DeepSeek-V4
  model (SGLang replaces the name by ``dsv4`` for that model) turns the same routing on
  (:func:`route_dsv4_when_named`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from nsa_backend_integrations.sglang.settings import (
    TAKEOVER_ENV,
    SglangSettings,
    check_impl_choice,
    check_resolved_layout,
    load_settings,
    scaled_layout_phase_defaults,
)

logger = logging.getLogger("nsa_backend.sglang")

BACKEND_NAME = "nsa_backend"
"""The ``--attention-backend`` value that selects nsa-backend."""
TAKEOVER_NAMES: tuple[str, ...] = ("dsa", "nsa")
"""SGLang's built-in DSA backend names served by nsa-backend under ``takeover``."""
RESOLUTION_STEP = "handle_model_specific_adjustments"
"""SGLang's resolution step (``arg_groups/pipeline.py``) that declares the DSA KV-cache dtype and the
per-phase DSA kernels (``_dsa_kv_cache_dtype_default``, ``_dsa_split_backend_resolution``)."""

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
            _register_resolution_hook()
            _patch_check_server_args()
            if settings.takeover:
                _activate_dsv4()
        except Exception:
            # SGLang's loader only logs a failing plugin; say it in our logger too.
            logger.exception("nsa-backend: registering the SGLang plugin failed")
            raise
        _settings, _served, _registered = settings, names, True
    logger.info("nsa-backend: SGLang attention backend registered as %s", ", ".join(names))


def _activate_dsv4() -> list[str]:
    """Route the DeepSeek-V4 ``dsv4`` backend's kernels through nsa-backend in this process (idempotent)."""
    from nsa_backend_integrations.sglang import dsv4, kernels

    return list(kernels.activate_deep_gemm() or []) + dsv4.activate()


def route_dsv4_when_named(server_args: Any, hf: dict) -> bool:
    """Turn on the DeepSeek-V4 routing when the user named nsa-backend's backend for a DeepSeek-V4 model.

    SGLang serves DeepSeek-V4 with its ``dsv4`` backend whatever ``--attention-backend`` says, so the
    raw flag is the user's choice. The routing is installed in this process and, through
    ``NSA_BACKEND_SGLANG_TAKEOVER=1`` in the environment the scheduler / TP workers inherit, in theirs
    (their plugin registration reads it). Returns whether it was turned on.
    """
    from nsa_backend.routing.device import DEEPSEEK_V4, model_family

    named = getattr(server_args, "attention_backend", None) == BACKEND_NAME
    if not named or model_family(hf) != DEEPSEEK_V4:
        return False
    replaced = _activate_dsv4()
    os.environ[TAKEOVER_ENV] = "1"
    logger.info("nsa-backend: --attention-backend %s with a DeepSeek-V4 model: SGLang's dsv4 backend kernels "
                "routed per call (%s)", BACKEND_NAME, ", ".join(replaced) or "already")
    return True


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


def _register_resolution_hook() -> None:
    """Wrap SGLang's DSA resolution step with :func:`resolve_scaled_fp8_layout` (plugins load before
    the server arguments are resolved, so the wrapper is in place for ``resolve_once()``)."""
    try:
        from sglang.srt.arg_groups import resolution_hooks
    except ImportError:  # pragma: no cover - releases without plugin resolution hooks
        logger.warning(
            "nsa-backend: this SGLang release has no resolution hooks; an FP8 cache whose DSA kernels SGLang "
            "resolves to trtllm is refused at startup instead of resolved to the scaled layout"
        )
        return
    registered = getattr(resolution_hooks, "_HOOKS", {}).get(RESOLUTION_STEP, ())
    if any(getattr(fn, _MARK, False) for fn in registered):
        return

    def resolve_dsa_phases(server_args: Any, previous: Callable[[Any], None]) -> None:
        previous(server_args)
        resolve_scaled_fp8_layout(server_args)

    setattr(resolve_dsa_phases, _MARK, True)
    resolution_hooks.register_resolution_hook(RESOLUTION_STEP)(resolve_dsa_phases)


def nsa_backend_scaled_fp8_layout(view: Any) -> dict:
    """SGLang post-process pass (``view`` -> declarations) of :func:`resolve_scaled_fp8_layout`.

    Its name is the source SGLang records with the declarations (``_resolved_overrides``).
    """
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, record_of

    served = served_names()
    prefill_backend, decode_backend = attention_backends_of(view)
    # The record's own fields keep the raw input while SGLang resolves (its declarations are kept
    # apart), so they say whether the user typed --dsa-*-backend.
    record = record_of(view)
    user_flags = (getattr(record, "dsa_prefill_backend", None), getattr(record, "dsa_decode_backend", None))
    resolved = (getattr(view, "dsa_prefill_backend", None), getattr(view, "dsa_decode_backend", None))
    kv = str(getattr(view, "kv_cache_dtype", "auto") or "auto")
    declared = scaled_layout_phase_defaults(
        kv,
        resolved,
        user_flags,
        (prefill_backend in served, decode_backend in served),
        getattr(view, "disaggregation_mode", None),
    )
    if declared:
        logger.info(
            "nsa-backend: SGLang resolved --dsa-prefill-backend %r / --dsa-decode-backend %r with "
            "--kv-cache-dtype %s, which allocates TRT-LLM's raw FP8 KV-cache rows (576 B/token, no scales) "
            "that nsa-backend's ops cannot read; nsa-backend serves the attention backend (%s / %s) and "
            "no --dsa-*-backend flag chose them, so resolving %s (scaled fp8_ds_mla rows, 656 B/token)",
            *resolved,
            kv,
            prefill_backend,
            decode_backend,
            ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in declared.items()),
        )
    return declared


def resolve_scaled_fp8_layout(server_args: Any) -> None:
    """Declare scaled-layout DSA phase kernels on ``server_args`` where SGLang picked a raw FP8 layout.

    Runs inside SGLang's resolution, right after the step that resolves the FP8 cache and the
    per-phase DSA kernels, so every later step (pool sizing, the fused-RoPE decision of the model
    code, the startup check) sees the replaced names. A phase is replaced only when its resolved
    kernel is ``trtllm``, the user gave no ``--dsa-<phase>-backend`` and nsa-backend serves its
    attention backend (:func:`~nsa_backend_integrations.sglang.settings.scaled_layout_phase_defaults`).
    """
    from sglang.srt.arg_groups.overrides import run_post_process_pass

    run_post_process_pass(server_args, nsa_backend_scaled_fp8_layout)


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


def refuse_name_keyed_paths(view: Any, served_prefill: bool, served_decode: bool) -> None:
    """Refuse the SGLang features keyed on the ``dsa`` / ``nsa`` names that nsa-backend's backend cannot run.

    ``view`` is SGLang's resolved view of the server arguments; ``served_prefill`` / ``served_decode``:
    whether nsa-backend's backend serves the prefill / decode attention backend. Raises ``ValueError``
    naming the flag and the alternative.
    """
    served = served_prefill or served_decode
    if not served:
        return
    takeover_off = (
        f"or serve with SGLang's own backend: unset {TAKEOVER_ENV} / [sglang] takeover and launch with "
        "--attention-backend dsa"
    )
    cp_size = int(getattr(view, "attn_cp_size", 1) or 1)
    if served_prefill and (bool(getattr(view, "enable_prefill_cp", False)) or cp_size > 1):
        raise ValueError(
            "nsa-backend: prefill context parallelism (--enable-prefill-cp / --attn-cp-size "
            f"{cp_size}) is not supported: nsa-backend's backend does not take "
            "context-parallel prefill shards. Drop --enable-prefill-cp and use --attn-cp-size 1, "
            + takeover_off
            + "."
        )
    if bool(getattr(view, "enable_kv_cache_sharding", False)):
        raise ValueError(
            "nsa-backend: --enable-kv-cache-sharding is not supported: SGLang's DSA KV sharding needs its "
            "own TRT-LLM kernels for both phases and prefill context parallelism. Drop "
            "--enable-kv-cache-sharding, " + takeover_off + "."
        )
    if str(getattr(view, "dsa_paged_mqa_logits_backend", "auto")) == "cutedsl":
        raise ValueError(
            "nsa-backend: --dsa-paged-mqa-logits-backend cutedsl is not supported: it bypasses the indexer "
            "kernels nsa-backend routes. Use --dsa-paged-mqa-logits-backend auto (nsa-backend's "
            "fp8_paged_mqa_logits, DeepGEMM's kernel where it exists)."
        )
    topk = getattr(view, "speculative_eagle_topk", None)
    if getattr(view, "speculative_algorithm", None) and topk is not None and int(topk) > 1:
        raise ValueError(
            f"nsa-backend: --speculative-eagle-topk {topk} is not supported: DSA speculative decoding "
            "drafts one chain (a tree needs page size 1, and DSA pages hold 64 tokens). Use "
            "--speculative-eagle-topk 1."
        )


def validate_server_args(server_args: Any) -> tuple[str, str] | None:
    """Validate a server whose attention backend is served by nsa-backend.

    Reads SGLang's resolved arguments (``resolved_view``: the user's flags plus the declarations of
    ``ServerArgs.resolve_once()``, e.g. the FP8 cache and per-phase DSA kernels SGLang picks for the
    GPU). Refuses the ``dsa``-keyed features nsa-backend cannot run (:func:`refuse_name_keyed_paths`),
    validates the implementation choice, and refuses resolved DSA kernels whose FP8 cache layout
    nsa-backend cannot read (:func:`~nsa_backend_integrations.sglang.settings.check_resolved_layout`).

    Returns ``(prefill_choice, decode_choice)``, or ``None`` when nsa-backend is not selected.
    Raises :class:`nsa_backend.routing.ImplChoiceError` or ``ValueError`` with the reason.
    """
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

    if getattr(server_args, "attention_backend", None) == BACKEND_NAME:
        route_dsv4_when_named(server_args, _hf_config(server_args))
    view = resolved_view(server_args)
    served = served_names() or (BACKEND_NAME,)
    prefill_backend, decode_backend = attention_backends_of(view)
    if prefill_backend not in served and decode_backend not in served:
        return None
    refuse_name_keyed_paths(view, prefill_backend in served, decode_backend in served)
    hf = _hf_config(server_args)
    archs = hf.get("architectures") or ["?"]
    kv = str(getattr(view, "kv_cache_dtype", "auto") or "auto")
    # The user's choice is the raw flag (what was typed); SGLang's own defaults are not a choice.
    choice = check_impl_choice(
        archs[0],
        kv,
        getattr(server_args, "dsa_prefill_backend", None),
        getattr(server_args, "dsa_decode_backend", None),
    )
    check_resolved_layout(
        kv,
        (getattr(view, "dsa_prefill_backend", None), getattr(view, "dsa_decode_backend", None)),
        choice,
        getattr(view, "disaggregation_mode", None),
    )
    logger.info(
        "nsa-backend: %s prefill=%s decode=%s accepted (SGLang's resolved DSA kernels %s / %s, %s cache)",
        archs[0],
        *choice,
        getattr(view, "dsa_prefill_backend", None),
        getattr(view, "dsa_decode_backend", None),
        kv,
    )
    return choice
