"""Entry point of the vLLM integration (``vllm.general_plugins``: ``nsa_backend``).

vLLM calls :func:`register` once in every process it starts (API server, engine core, workers)
before it builds configs or models. The call is idempotent and cheap; a step that fails is logged
on the ``nsa_backend.vllm`` logger at ERROR level and recorded in :func:`registration_state`,
while the other steps still run (vLLM does not catch exceptions from plugin functions, so
raising would stop the server even for an optional step).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from nsa_backend_integrations.vllm.config import (
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
    ``hc_prenorm`` (whether the DeepGEMM function is routed), ``deepseek_v4`` (the wrapped DeepSeek-V4
    attention selector, ``None`` where vLLM has none) and ``errors`` (step -> message)."""
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
        _state["deepseek_v4"] = _run_step("deepseek-v4 attention", install_deepseek_v4, settings)
        logger.debug("nsa-backend: vLLM plugin registered: %s", registration_state())


def _register_indexer(mode: str) -> str:
    from nsa_backend_integrations.vllm.indexer import register_oot_indexer

    cls = register_oot_indexer(mode)
    return f"{cls.__module__}.{cls.__qualname__}"


def _install_hc_prenorm(mode: str) -> Any:
    from nsa_backend_integrations.vllm.mhc import install

    return install(mode)


# --- DeepSeek-V4 --------------------------------------------------------------------------------
# vLLM's DeepSeek-V4 models build their attention from their own classes, chosen per layer by
# ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls``; CUSTOM and the takeover names never
# reach them. ``dsv4.install`` wraps that selector so that nsa-backend's DeepSeek-V4 attention is
# chosen when nsa-backend is named, or under takeover where vLLM's class has no kernel.

DSV4_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"


def install_deepseek_v4(settings: VllmSettings) -> str | None:
    """Wrap vLLM's DeepSeek-V4 attention selector (see ``dsv4``); returns its path, ``None`` where
    this vLLM has no DeepSeek-V4 NVIDIA model."""
    import importlib.util

    if importlib.util.find_spec(DSV4_MODEL_MODULE.rsplit(".", 1)[0]) is None:
        return None
    from nsa_backend_integrations.vllm import dsv4

    return dsv4.install(settings, _arch_or_none)


def _arch_or_none() -> str | None:
    """This process's GPU arch family when a DeepSeek-V4 layer is built (``None`` without one)."""
    try:
        return _platform_arch()
    except Exception:   # a platform without a usable device query
        return None
