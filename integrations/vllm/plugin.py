"""Entry point of the vLLM integration (``vllm.general_plugins``: ``nsa_backend``).

vLLM calls :func:`register` once in every process it starts (API server, engine core, workers)
before it builds configs or models. The call is idempotent and cheap; a step that fails is logged
on the ``nsa_backend.vllm`` logger at ERROR level and recorded in :func:`registration_state`,
while the other steps still run (vLLM does not catch exceptions from plugin functions, so
raising would stop the server even for an optional step).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from nsa_backend_integrations.vllm.config import (
    TAKEOVER_ENV,
    TAKEOVER_NAMES,
    VllmSettings,
    auto_takeover_names,
    load_settings,
)

logger = logging.getLogger("nsa_backend.vllm")

BACKEND_MODULE = "nsa_backend_integrations.vllm.backend"
CUSTOM_BACKEND_PATH = f"{BACKEND_MODULE}.NsaSparseMLABackend"
TAKEOVER_BACKEND_PATHS: dict[str, str] = {
    "FLASHMLA_SPARSE": f"{BACKEND_MODULE}.FlashMLASparseTakeoverBackend",
    "FLASHINFER_MLA_SPARSE_SM120": f"{BACKEND_MODULE}.FlashInferSM120TakeoverBackend",
}
assert set(TAKEOVER_BACKEND_PATHS) == set(TAKEOVER_NAMES)

_lock = threading.Lock()
_state: dict[str, Any] = {"registered": False, "calls": 0, "errors": {}}


def registration_state() -> dict[str, Any]:
    """What :func:`register` did in this process: ``registered``, ``calls``, ``settings``, ``arch``,
    ``custom_backend``, ``takeover`` (names served), ``indexer`` (the OOT class name or None),
    ``hc_prenorm`` (whether the DeepGEMM function is routed), ``deepseek_v4_refusal`` (the model
    architectures whose start-up refuses a request for nsa-backend, see
    :func:`refuse_deepseek_v4_request`) and ``errors`` (step -> message)."""
    return {**_state, "errors": dict(_state["errors"])}


def _platform_arch() -> str | None:
    """Arch family of this machine's GPU without initialising CUDA (vLLM reads it through NVML);
    ``None`` without a GPU. ``NSA_BACKEND_FORCE_ARCH`` / ``force_arch`` replace the answer."""
    from nsa_backend import envs
    from nsa_backend.routing import family_from_capability
    from nsa_backend.routing.config import ConfigError, get_config

    try:
        forced = get_config().force_arch
    except ConfigError:
        forced = envs.get(envs.FORCE_ARCH)
    if forced is not None:
        return forced
    from vllm.platforms import current_platform

    try:
        capability = current_platform.get_device_capability()
    except Exception:  # a platform without a usable device query
        capability = None
    if capability is None:
        return None
    return family_from_capability(capability.major, capability.minor)


def _register_backends(settings: VllmSettings, arch: str | None) -> tuple[str, ...]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, class_path=CUSTOM_BACKEND_PATH)
    names = auto_takeover_names(arch) if settings.takeover == "auto" else settings.takeover
    served = []
    for name in names:
        member = AttentionBackendEnum.__members__.get(name)
        if member is None:
            logger.warning("nsa-backend: this vLLM has no attention backend %s to take over", name)
            continue
        register_backend(member, class_path=TAKEOVER_BACKEND_PATHS[name])
        served.append(name)
    if served:
        logger.info("nsa-backend: serving vLLM attention backends %s", ", ".join(served))
    return tuple(served)


def _run_step(name: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        _state["errors"][name] = f"{type(exc).__name__}: {exc}"
        logger.exception("nsa-backend: vLLM plugin step %r failed", name)
        return None


def planned_replacements(settings: VllmSettings, arch: str | None) -> tuple[bool, bool]:
    """``(replace the indexer op, route the mHC GEMM)`` for ``settings`` (``arch``: the GPU's family,
    ``None`` without one). ``auto`` installs both everywhere: each indexer layer and each mHC GEMM
    call then keeps vLLM's DeepGEMM wherever it serves that shape on this GPU
    (``config.deep_gemm_serves_indexer`` / ``deep_gemm_serves_hc_prenorm``) and runs nsa-backend
    elsewhere, so a GPU whose DeepGEMM covers only some shapes is served for the others."""
    return settings.indexer != "off", settings.hc_prenorm != "off"


def register() -> None:
    """Register nsa-backend with vLLM (see the module docstring); safe to call repeatedly.

    In ``auto`` mode the replaced indexer and mHC GEMM keep vLLM's DeepGEMM per layer / per call
    wherever it serves the shape (the process's GPU is read through NVML, without initialising CUDA).
    """
    with _lock:
        _state["calls"] += 1
        if _state["registered"]:
            return
        _state["registered"] = True
        settings = _run_step("settings", load_settings)
        if settings is None:
            settings = VllmSettings(takeover=(), indexer="off", hc_prenorm="off")
        _state["settings"] = settings
        arch = _run_step("platform", _platform_arch)
        _state["arch"] = arch
        served = _run_step("attention backend", _register_backends, settings, arch)
        _state["custom_backend"] = CUSTOM_BACKEND_PATH if served is not None else None
        _state["takeover"] = served or ()
        replace_indexer, route_hc_prenorm = planned_replacements(settings, arch)
        _state["indexer"] = None
        if replace_indexer:
            _state["indexer"] = _run_step("indexer op", _register_indexer, settings.indexer)
        _state["hc_prenorm"] = False
        if route_hc_prenorm:
            routed = _run_step("hc_prenorm", _install_hc_prenorm, settings.hc_prenorm)
            _state["hc_prenorm"] = routed is not None
        _state["deepseek_v4_refusal"] = _run_step("deepseek-v4 refusal", install_deepseek_v4_refusal) or ()
        logger.debug("nsa-backend: vLLM plugin registered: %s", registration_state())


def _register_indexer(mode: str) -> str:
    from nsa_backend_integrations.vllm.indexer import register_oot_indexer

    cls = register_oot_indexer(mode)
    return f"{cls.__module__}.{cls.__qualname__}"


def _install_hc_prenorm(mode: str) -> Any:
    from nsa_backend_integrations.vllm.mhc import install

    return install(mode)


# --- DeepSeek-V4 --------------------------------------------------------------------------------
# vLLM's DeepSeek-V4 models (DeepseekV4ForCausalLM, its vision variant, DeepseekV41ForCausalLM) build
# their attention from their own classes, chosen by GPU arch or by a *_DSV4 backend name
# (``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls``); CUSTOM and the takeover names
# never reach them. nsa-backend has no DeepSeek-V4 sparse-MLA op (its ops serve the 656-byte
# fp8_ds_mla and bf16 caches of DeepSeek-V3.2 / GLM-5), so a request for it with such a model is
# refused where vLLM resolves the model's config: the model's ``verify_and_update_config`` hook,
# which ``VllmConfig.__post_init__`` runs through ``MODELS_CONFIG_MAP`` before any worker starts.

_DSV4_CONFIG_CLASS = "DeepseekV4ForCausalLMConfig"


def _registered_as(name: str, class_path: str) -> bool:
    """Whether vLLM's attention backend ``name`` resolves to ``class_path`` in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.__members__.get(name)
    return member is not None and member.is_overridden() and member.get_path() == class_path


def nsa_backend_request(vllm_config: Any) -> tuple[str, str] | None:
    """How ``vllm_config`` asks for nsa-backend's attention, and how to stop asking, in the user's
    words (``(request, remedy)``), or ``None`` when it does not.

    Asked for: ``--attention-backend CUSTOM`` while CUSTOM is nsa-backend's, or ``--attention-backend
    NAME`` for a takeover name served by nsa-backend (the ``[vllm] takeover`` setting). Takeover with
    no backend named is not a request for this launch: it is a standing setting (the Docker image's
    ``auto``) that replaces vLLM's DeepSeek-V3.2 backends by name, and a DeepSeek-V4 model never
    looks those names up. A backend named that nsa-backend does not serve (e.g.
    ``FLASHMLA_SPARSE_DSV4``) is not a request for it either.
    """
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    name = backend if isinstance(backend, str) or backend is None else backend.name
    if name == "CUSTOM":
        if not _registered_as("CUSTOM", CUSTOM_BACKEND_PATH):
            return None
        return "--attention-backend CUSTOM", "drop --attention-backend CUSTOM"
    served = [n for n, path in TAKEOVER_BACKEND_PATHS.items() if _registered_as(n, path)]
    if name is None or name not in served:
        return None
    return (
        f"--attention-backend {name} with the nsa-backend [vllm] takeover setting (config file or "
        f"{TAKEOVER_ENV}), which serves {', '.join(served)} with nsa-backend",
        f'set takeover = "off" in the [vllm] table of the nsa-backend config file (or {TAKEOVER_ENV}=off)',
    )


def refuse_deepseek_v4_request(vllm_config: Any) -> None:
    """Raise when ``vllm_config`` asks for nsa-backend with a DeepSeek-V4 model (see
    :func:`nsa_backend_request`); do nothing when it does not.

    Raises
    ------
    ValueError
        Naming the model, how nsa-backend was asked for and how to run the model on vLLM's own
        DeepSeek-V4 attention instead.
    """
    request = nsa_backend_request(vllm_config)
    if request is None:
        return
    asked, remedy = request
    architecture = getattr(getattr(vllm_config, "model_config", None), "architecture", None) or "DeepSeek-V4"
    raise ValueError(
        f"nsa-backend cannot serve {architecture} (DeepSeek-V4), which was asked for by {asked}: "
        "nsa-backend's sparse-MLA ops serve the DeepSeek-V3.2 / GLM-5 KV caches (bfloat16 and the "
        "656-byte fp8_ds_mla rows), not DeepSeek-V4's, and vLLM builds DeepSeek-V4 attention from its own "
        "classes, which never reach nsa-backend. To run the model on vLLM's own DeepSeek-V4 attention, "
        f"{remedy} (vLLM has no DeepSeek-V4 attention kernel for SM8x GPUs)."
    )


@functools.cache
def _refusing_config_class(original: type) -> type:
    """``original`` (vLLM's DeepSeek-V4 config hook class) whose ``verify_and_update_config``
    first refuses a request for nsa-backend, then runs vLLM's."""

    def verify_and_update_config(vllm_config: Any) -> None:
        refuse_deepseek_v4_request(vllm_config)
        original.verify_and_update_config(vllm_config)

    return type(original.__name__, (original,), {
        "__module__": __name__,
        "__doc__": f"vLLM's {original.__name__}, refusing a request for nsa-backend first.",
        "verify_and_update_config": staticmethod(verify_and_update_config),
        "nsa_backend_original": original,
    })


def install_deepseek_v4_refusal() -> tuple[str, ...]:
    """Put the refusing hook into vLLM's ``MODELS_CONFIG_MAP`` for every architecture mapped to
    vLLM's DeepSeek-V4 config class; returns those architectures (empty where vLLM has no
    DeepSeek-V4). Idempotent."""
    from vllm.model_executor.models import config as model_configs

    original = getattr(model_configs, _DSV4_CONFIG_CLASS, None)
    if original is None:
        return ()
    refusing = _refusing_config_class(original)
    config_map = model_configs.MODELS_CONFIG_MAP
    installed = []
    for architecture, cls in list(config_map.items()):
        if cls is original or cls is refusing:
            config_map[architecture] = refusing
            installed.append(architecture)
    return tuple(installed)
