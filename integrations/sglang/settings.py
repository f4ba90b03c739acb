"""Settings of the SGLang integration and the implementation choice checked at startup.

::

    # $NSA_BACKEND_CONFIG
    [sglang]
    takeover = false      # true: serve SGLang's built-in "dsa" / "nsa" backend names with nsa-backend

``takeover`` (``true`` / ``false``, default ``false``): also register nsa-backend's backend under
SGLang's ``dsa`` and ``nsa`` names, so existing launch commands pick nsa-backend's kernels, and
route the DeepGEMM indexer / mHC calls of the DeepSeek-V4 ``dsv4`` backend through nsa-backend.

The environment variable ``NSA_BACKEND_SGLANG_TAKEOVER`` (``1``/``0``, ``on``/``off``) overrides the file.

The prefill / decode implementation is chosen per phase, first match wins:

1. SGLang's ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` when given on the command line
   (SGLang names such as ``flashmla_sparse``, ``flashinfer_sparse_mla``, ``fa3``, ``trtllm``);
2. nsa-backend's ``prefill`` / ``decode`` op-family setting (``NSA_BACKEND_PREFILL`` /
   ``NSA_BACKEND_DECODE`` or the config file: ``auto``, ``reference``, ``triton``, ``flash_mla``,
   ``flashinfer``);
3. ``auto``.

The pair is checked with :func:`nsa_backend.routing.validate_impl_choice` when the server starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from nsa_backend import envs

TAKEOVER_ENV = "NSA_BACKEND_SGLANG_TAKEOVER"
KEYS: tuple[str, ...] = ("takeover",)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no", "")

# nsa-backend op-family implementation -> the validator's name, per phase and KV-cache dtype.
_FAMILY_TO_CHOICE: dict[str, str] = {
    "auto": "auto",
    "reference": "reference",
    "triton": "triton",
    "flashinfer": "flashinfer_sparse_mla",
}


@dataclasses.dataclass(frozen=True)
class SglangSettings:
    """Resolved ``[sglang]`` settings."""

    takeover: bool = False


def _parse_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{source}: expected true or false, got {value!r}")


def _config_table(path: str | None) -> Mapping[str, Any]:
    """The ``[sglang]`` table of the config file (empty when there is none)."""
    if not path:
        return {}
    from nsa_backend.routing.config import load_config

    return load_config(path).integrations.get("sglang", {})


def load_settings(path: str | None = None, overrides: Mapping[str, Any] | None = None) -> SglangSettings:
    """Read the settings: config file (``path`` or ``$NSA_BACKEND_CONFIG``), environment, ``overrides``."""
    if path is None:
        path = envs.get(envs.CONFIG)
    raw: dict[str, Any] = dict(_config_table(path))
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"{path}: [sglang]: unknown keys {unknown}; accepted keys: {list(KEYS)}")
    value = os.environ.get(TAKEOVER_ENV)
    if value:
        raw["takeover"] = value
    raw.update(overrides or {})
    source = f"environment variable {TAKEOVER_ENV}" if value else f"{path}: [sglang] takeover"
    return SglangSettings(takeover=_parse_bool(raw.get("takeover", False), source))


def family_to_choice(family_impl: str, phase: str, kv_cache_dtype: str) -> str:
    """Validator name of an nsa-backend op-family implementation for ``phase``.

    ``flash_mla`` means FlashMLA's sparse prefill kernel, and for decode FlashMLA's FP8 sparse
    decode kernel (``flashmla_kv``) with an FP8 cache or its bf16 sparse kernel otherwise.
    """
    if family_impl == "flash_mla":
        if phase == "decode" and kv_cache_dtype in ("fp8_e4m3", "fp8", "fp8_ds_mla"):
            return "flashmla_kv"
        return "flashmla_sparse"
    return _FAMILY_TO_CHOICE.get(family_impl, family_impl)


def resolve_impl_choice(
    phase: str,
    sglang_flag: str | None,
    kv_cache_dtype: str,
    device_arch: str | None = None,
    model_arch: str | None = None,
) -> tuple[str, str]:
    """``(choice, where it came from)`` for ``phase`` (``"prefill"`` or ``"decode"``).

    ``sglang_flag`` is the value the user gave to ``--dsa-<phase>-backend`` (``None``: not given).
    """
    if sglang_flag:
        return sglang_flag, f"--dsa-{phase}-backend"
    from nsa_backend.routing import get_config

    family_impl, where = get_config().choice(phase, device_arch, model_arch)
    return family_to_choice(family_impl, phase, kv_cache_dtype), where


def check_impl_choice(
    model_arch: str,
    kv_cache_dtype: str,
    prefill_flag: str | None = None,
    decode_flag: str | None = None,
    device_arch: str | None = None,
) -> tuple[str, str]:
    """Resolve and validate the prefill / decode implementation choice of a server.

    Raises :class:`nsa_backend.routing.ImplChoiceError` (a ``ValueError``) with the validator's
    message when the pair cannot run; returns ``(prefill_choice, decode_choice)`` otherwise.
    ``device_arch`` defaults to the forced arch (``NSA_BACKEND_FORCE_ARCH`` / ``force_arch``), else
    :func:`nsa_backend.routing.detect_arch`.
    """
    from nsa_backend.routing import detect_arch, validate_impl_choice
    from nsa_backend.routing.device import forced_arch

    if device_arch is None:
        device_arch = forced_arch() or detect_arch()
    prefill, _ = resolve_impl_choice("prefill", prefill_flag, kv_cache_dtype, device_arch, model_arch)
    decode, _ = resolve_impl_choice("decode", decode_flag, kv_cache_dtype, device_arch, model_arch)
    validate_impl_choice(model_arch, device_arch, kv_cache_dtype, prefill, decode)
    return prefill, decode
