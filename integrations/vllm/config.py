"""Settings of the vLLM integration: the ``[vllm]`` table of the nsa-backend config file.

::

    # $NSA_BACKEND_CONFIG
    [vllm]
    takeover = "off"      # "off" | "auto" | "on" | ["FLASHINFER_MLA_SPARSE_SM120", "FLASHMLA_SPARSE"]
    indexer = "auto"      # "auto" | "on" | "off"
    hc_prenorm = "auto"   # "auto" | "on" | "off"

- ``takeover`` (``off``, ``auto``, ``on`` or a list of backend names; default ``off``): serve vLLM's
  sparse-MLA backend names with nsa-backend. ``auto``: ``FLASHINFER_MLA_SPARSE_SM120`` on SM12x and
  ``FLASHMLA_SPARSE`` on SM8x (GPUs without a native sparse-MLA kernel); ``on``: both names on every GPU.
- ``indexer`` (``auto``, ``on``, ``off``; default ``auto``): replace vLLM's ``SparseAttnIndexer``.
  ``auto``: on every GPU except SM90/SM100, where DeepGEMM has indexer kernels and vLLM's op stays.
- ``hc_prenorm`` (``auto``, ``on``, ``off``; default ``auto``): route DeepGEMM's ``tf32_hc_prenorm_gemm``
  to nsa-backend. ``auto``: on GPUs other than SM90/SM100.

Each key can be overridden by an environment variable (``NSA_BACKEND_VLLM_TAKEOVER``,
``NSA_BACKEND_VLLM_INDEXER``, ``NSA_BACKEND_VLLM_HC_PRENORM``); a takeover list is written
comma-separated there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("nsa_backend.vllm")

TAKEOVER_ENV = "NSA_BACKEND_VLLM_TAKEOVER"
INDEXER_ENV = "NSA_BACKEND_VLLM_INDEXER"
HC_PRENORM_ENV = "NSA_BACKEND_VLLM_HC_PRENORM"

# vLLM sparse-MLA backend names that nsa-backend can serve.
TAKEOVER_NAMES: tuple[str, ...] = ("FLASHINFER_MLA_SPARSE_SM120", "FLASHMLA_SPARSE")
MODES: tuple[str, ...] = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """Resolved ``[vllm]`` settings.

    ``takeover`` is ``"auto"`` or the explicit tuple of vLLM backend names to serve (empty: none).
    """

    takeover: str | tuple[str, ...] = ()
    indexer: str = "auto"
    hc_prenorm: str = "auto"


def _parse_takeover(value: Any, source: str) -> str | tuple[str, ...]:
    if isinstance(value, str):
        word = value.strip()
        if word.lower() in ("off", "false", "0", "no", "none", ""):
            return ()
        if word.lower() in ("on", "true", "1", "yes", "all"):
            return TAKEOVER_NAMES
        if word.lower() == "auto":
            return "auto"
        names: list[Any] = [w.strip() for w in word.split(",") if w.strip()]
    elif isinstance(value, bool):
        return TAKEOVER_NAMES if value else ()
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise ValueError(
            f"{source}: expected 'off', 'auto', 'on' or a list of {list(TAKEOVER_NAMES)}, got {value!r}"
        )
    bad = [n for n in names if n not in TAKEOVER_NAMES]
    if bad:
        raise ValueError(f"{source}: expected backend names from {list(TAKEOVER_NAMES)}, got {bad}")
    return tuple(dict.fromkeys(names))


def _parse_mode(value: Any, source: str) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or value.strip().lower() not in MODES:
        raise ValueError(f"{source}: expected one of {list(MODES)}, got {value!r}")
    return value.strip().lower()


def _config_table() -> Mapping[str, Any]:
    """The ``[vllm]`` table of the file named by ``NSA_BACKEND_CONFIG`` (empty when there is none)."""
    from nsa_backend.routing.config import load_config

    return load_config().integrations.get("vllm", {})


def load_settings(overrides: Mapping[str, Any] | None = None) -> VllmSettings:
    """Read the settings: config file, then environment variables, then ``overrides``."""
    raw: dict[str, Any] = dict(_config_table())
    unknown = sorted(set(raw) - {"takeover", "indexer", "hc_prenorm"})
    if unknown:
        raise ValueError(f"[vllm] config: unknown keys {unknown}; expected takeover, indexer, hc_prenorm")
    for key, var in (("takeover", TAKEOVER_ENV), ("indexer", INDEXER_ENV), ("hc_prenorm", HC_PRENORM_ENV)):
        value = os.environ.get(var)
        if value:
            raw[key] = value
    raw.update(overrides or {})
    return VllmSettings(
        takeover=_parse_takeover(raw.get("takeover", "off"), "vllm.takeover"),
        indexer=_parse_mode(raw.get("indexer", "auto"), "vllm.indexer"),
        hc_prenorm=_parse_mode(raw.get("hc_prenorm", "auto"), "vllm.hc_prenorm"),
    )


def auto_takeover_names(arch: str | None) -> tuple[str, ...]:
    """Backend names that nsa-backend serves under ``takeover = "auto"`` on arch family ``arch``.

    sm120 / sm121: ``FLASHINFER_MLA_SPARSE_SM120`` (FlashInfer covers only fixed decode buckets there).
    sm80 / sm86 / sm89: ``FLASHMLA_SPARSE`` (vLLM has no sparse-MLA kernel below SM90). Elsewhere: none.
    """
    if arch in ("sm120", "sm121"):
        return ("FLASHINFER_MLA_SPARSE_SM120",)
    if arch in ("sm80", "sm86", "sm89"):
        return ("FLASHMLA_SPARSE",)
    return ()


def deep_gemm_has_kernels(arch: str) -> bool:
    """Whether DeepGEMM ships indexer and mHC kernels for arch family ``arch`` (SM90 and SM100 only)."""
    return arch in ("sm90", "sm100", "sm103")


def announce_model(vllm_config: Any) -> None:
    """Tell nsa-backend's routing which HF architecture is served (``[model.<arch>]`` config sections)."""
    architectures = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    if architectures:
        from nsa_backend.routing import active_model, set_active_model

        if active_model() != architectures[0]:
            set_active_model(architectures[0])
