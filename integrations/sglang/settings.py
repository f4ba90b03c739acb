"""Settings of the SGLang integration and the implementation choice checked at startup.

::

    # $NSA_BACKEND_CONFIG
    [sglang]
    takeover = false      # true: serve SGLang's built-in "dsa" / "nsa" backend names with nsa-backend

``takeover`` (``true`` / ``false``, default ``false``): also register nsa-backend's backend under
SGLang's ``dsa`` and ``nsa`` names, so existing launch commands pick nsa-backend's kernels, and
route the DeepSeek-V4 ``dsv4`` backend's kernels per call (its DeepGEMM indexer / mHC calls, and its
sparse decode / prefill / KV-cache write where no native kernel serves the GPU and shape; see
:mod:`nsa_backend_integrations.sglang.dsv4`).

The environment variable ``NSA_BACKEND_SGLANG_TAKEOVER`` (``1``/``0``, ``on``/``off``) overrides the file.

The prefill / decode implementation is chosen per phase, first match wins:

1. SGLang's ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` when given on the command line
   (SGLang names such as ``flashmla_sparse``, ``flashinfer_sparse_mla``, ``fa3``, ``trtllm``);
2. nsa-backend's ``prefill`` / ``decode`` op-family setting (``NSA_BACKEND_PREFILL`` /
   ``NSA_BACKEND_DECODE`` or the config file: ``auto``, ``reference``, ``triton``, ``flash_mla``,
   ``flashinfer``);
3. ``auto``.

The pair is checked with :func:`nsa_backend.routing.validate_impl_choice` when the server starts.

The user's choice is the raw ``--dsa-*-backend`` value (what was typed). What SGLang will run is
its *resolved* choice (``ServerArgs.resolve_once()`` declares a default per phase for DSA models,
e.g. ``trtllm`` with an FP8 cache on major >= 10): it decides the KV-cache layout SGLang allocates
(``trtllm`` makes an FP8 pool raw, 576 B/token, instead of the scaled ``fp8_ds_mla`` 656 B/token)
and whether the model code leaves RoPE to the backend. When nsa-backend serves a phase and the user
gave no ``--dsa-*-backend`` flag for it, the plugin replaces such a raw-layout default by the names of
:data:`SCALED_FP8_PHASE_DEFAULTS` (:func:`scaled_layout_phase_defaults`), so SGLang allocates the
scaled layout. :func:`check_resolved_layout` refuses what remains: a resolved choice whose layout
nsa-backend's kernels cannot read because the user chose it.
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


def uses_raw_fp8_layout(
    kv_cache_dtype: str,
    resolved_prefill: str | None,
    resolved_decode: str | None,
    disaggregation_mode: str | None = None,
) -> bool:
    """Whether SGLang allocates TRT-LLM's raw FP8 MLA rows (no scales) for these resolved choices.

    Mirrors SGLang's pool sizing (``calculate_mla_kv_cache_dim``): a PD decode worker looks at the
    decode choice only, a PD prefill worker at the prefill choice, any other server at both.
    """
    if kv_cache_dtype not in ("fp8_e4m3", "fp8"):
        return False
    if disaggregation_mode == "decode":
        phases = (resolved_decode,)
    elif disaggregation_mode == "prefill":
        phases = (resolved_prefill,)
    else:
        phases = (resolved_prefill, resolved_decode)
    return "trtllm" in phases


SCALED_FP8_PHASE_DEFAULTS: dict[str, str] = {"prefill": "flashmla_sparse", "decode": "flashmla_kv"}
"""SGLang's per-phase DSA kernel names that replace a raw-layout default (``trtllm``) with an FP8 cache.

SGLang sizes the pool by name (``calculate_mla_kv_cache_dim``): anything but ``trtllm`` (or a
``tilelang`` pair) gives the scaled ``fp8_ds_mla`` rows. These two are SGLang's own FlashMLA pair on
that layout; its DSA backend accepts them for every DSA model on CUDA except GLM with FP8 on SM12x,
where SGLang resolves ``flashinfer_sparse_mla`` (already scaled, so never replaced). They are not a
user's choice: the implementation of a phase nsa-backend serves still comes from
:func:`resolve_impl_choice` (raw flag, else nsa-backend's setting, else ``auto``)."""


def scaled_layout_phase_defaults(
    kv_cache_dtype: str,
    resolved: tuple[str | None, str | None],
    user_flags: tuple[str | None, str | None],
    served: tuple[bool, bool],
    disaggregation_mode: str | None = None,
) -> dict[str, str]:
    """SGLang phase kernels to declare so that its FP8 pool has the layout nsa-backend's ops read.

    Parameters
    ----------
    kv_cache_dtype
        SGLang's resolved KV-cache dtype (``"fp8_e4m3"``, ``"bfloat16"``, ...).
    resolved
        SGLang's resolved ``(dsa_prefill_backend, dsa_decode_backend)``.
    user_flags
        The raw ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` values (``None``: not given).
    served
        Whether nsa-backend's backend serves the prefill / decode attention backend.
    disaggregation_mode
        SGLang's ``--disaggregation-mode`` (decides which phases size the pool).

    Returns
    -------
    dict
        ``{"dsa_<phase>_backend": name}`` for each phase to replace (names from
        :data:`SCALED_FP8_PHASE_DEFAULTS`). Empty when the resolved layout is already one nsa-backend
        reads, or when a ``trtllm`` that sizes the pool was given by the user or runs on SGLang's own
        backend: replacing the others would not change the layout, and the startup check decides.
    """
    if not uses_raw_fp8_layout(kv_cache_dtype, *resolved, disaggregation_mode):
        return {}
    phases = ("prefill", "decode")
    replaceable = [
        phase
        for phase, name, flag, ours in zip(phases, resolved, user_flags, served)
        if name == "trtllm" and not flag and ours
    ]
    remaining = tuple(None if phase in replaceable else name for phase, name in zip(phases, resolved))
    if uses_raw_fp8_layout(kv_cache_dtype, *remaining, disaggregation_mode):
        return {}
    return {f"dsa_{phase}_backend": SCALED_FP8_PHASE_DEFAULTS[phase] for phase in replaceable}


def check_resolved_layout(
    kv_cache_dtype: str,
    resolved: tuple[str | None, str | None],
    choice: tuple[str, str],
    disaggregation_mode: str | None = None,
) -> None:
    """Refuse SGLang's resolved DSA kernels when they give an FP8 cache layout nsa-backend cannot read.

    ``resolved``: SGLang's resolved ``(dsa_prefill_backend, dsa_decode_backend)``; ``choice``: the
    validated ``(prefill, decode)`` choice of :func:`check_impl_choice`. A phase whose choice is one
    of SGLang's own kernels (``trtllm``, ``fa3``, ...) reads the pool itself; a phase on
    nsa-backend's ops needs the scaled ``fp8_ds_mla`` layout. Raises ``ValueError``.
    """
    from nsa_backend.routing.validate import CHOICE_TO_IMPL

    if not uses_raw_fp8_layout(kv_cache_dtype, *resolved, disaggregation_mode):
        return
    ours = [phase for phase, name in zip(("prefill", "decode"), choice) if CHOICE_TO_IMPL.get(name) is not None]
    if not ours:
        return
    raise ValueError(
        "nsa-backend: SGLang resolved --dsa-prefill-backend "
        f"{resolved[0]!r} / --dsa-decode-backend {resolved[1]!r} with --kv-cache-dtype fp8_e4m3, so it "
        "allocates TRT-LLM's raw FP8 KV-cache layout (no scales), which nsa-backend's kernels for the "
        f"{' and '.join(ours)} phase cannot read. Leave both --dsa-prefill-backend and --dsa-decode-backend "
        "unset (nsa-backend's ops for both phases; the scaled layout is then resolved), or pass "
        "--kv-cache-dtype bfloat16 (any GPU), or on SM90 / "
        "SM100 --dsa-prefill-backend flashmla_sparse --dsa-decode-backend flashmla_kv (FlashMLA on the "
        "scaled fp8_ds_mla layout), or --dsa-prefill-backend trtllm --dsa-decode-backend trtllm (SGLang's "
        "TRT-LLM kernels for both phases, SM100)."
    )


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
