"""User configuration of implementation choices: TOML file, environment, built-in defaults.

Precedence for the implementation of one op family, highest first:

1. the ``impl=`` argument of the call (anything but ``"auto"``);
2. the environment variable of the family (``NSA_BACKEND_INDEXER`` ...);
3. the config file: ``[model.<HF architecture>]``, then ``[arch.<family>]``, then ``[defaults]``;
4. built-in: ``"auto"`` (the capability table decides).

The file is named by ``NSA_BACKEND_CONFIG`` or passed explicitly (``nsa-backend plan --config``,
:func:`load_config`). Unknown sections, keys or values fail with the file path, the key and the
accepted values. See ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from nsa_backend._settings import ConfigError, set_forced_arch_source, settings_changed
from nsa_backend.routing.device import ARCH_FAMILIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIG_ENV = "NSA_BACKEND_CONFIG"
FORCE_ARCH_ENV = "NSA_BACKEND_FORCE_ARCH"
LOG_LEVEL_ENV = "NSA_BACKEND_LOG_LEVEL"

FAMILIES: tuple[str, ...] = ("indexer", "topk", "prefill", "decode", "hc_prenorm")
FAMILY_ENV: dict[str, str] = {family: f"NSA_BACKEND_{family.upper()}" for family in FAMILIES}
# Implementations a family key may name (every op of the family accepts "auto", "reference", "triton").
FAMILY_CHOICES: dict[str, tuple[str, ...]] = {
    "indexer": ("auto", "reference", "triton", "deep_gemm"),
    "topk": ("auto", "reference", "triton"),
    "prefill": ("auto", "reference", "triton", "flash_mla"),
    "decode": ("auto", "reference", "triton", "flash_mla", "flashinfer"),
    "hc_prenorm": ("auto", "reference", "triton", "deep_gemm"),
}
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
DEFAULTS_ONLY_KEYS: tuple[str, ...] = ("force_arch", "log_level")
SECTIONS: tuple[str, ...] = ("defaults", "arch", "model")
# Tables owned by the framework integrations (nsa_backend_integrations.<name> validates their keys).
INTEGRATION_SECTIONS: tuple[str, ...] = ("sglang", "vllm")

logger = logging.getLogger("nsa_backend")


@dataclasses.dataclass(frozen=True)
class Config:
    """The resolved configuration (file plus environment)."""

    path: str | None = None
    defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)
    arch: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    model: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    force_arch: str | None = None
    force_arch_source: str | None = None
    log_level: str = "warning"
    integrations: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """The ``[sglang]`` / ``[vllm]`` tables as read; each integration validates its own keys."""

    def choice(self, family: str, arch: str | None = None, model: str | None = None) -> tuple[str, str]:
        """``(implementation, where it came from)`` for an op family on ``arch`` running ``model``."""
        if family in self.env:
            return self.env[family], f"env {FAMILY_ENV[family]}"
        where = self.path or "config"
        if model is not None and family in self.model.get(model, {}):
            return self.model[model][family], f"{where} [model.{model}]"
        if arch is not None and family in self.arch.get(arch, {}):
            return self.arch[arch][family], f"{where} [arch.{arch}]"
        if family in self.defaults:
            return self.defaults[family], f"{where} [defaults]"
        return "auto", "built-in"


def _check_family_value(family: str, value: Any, where: str) -> str:
    choices = FAMILY_CHOICES[family]
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{where}: key {family!r} has unknown value {value!r}; accepted values: {list(choices)}")
    return value


def _parse_section(table: Any, where: str, *, defaults: bool) -> dict[str, str]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of keys, got {type(table).__name__}")
    accepted = [*FAMILIES, *DEFAULTS_ONLY_KEYS] if defaults else list(FAMILIES)
    out: dict[str, str] = {}
    for key, value in table.items():
        if key in FAMILIES:
            out[key] = _check_family_value(key, value, where)
        elif key == "force_arch" and defaults:
            if not isinstance(value, str) or value not in ARCH_FAMILIES:
                raise ConfigError(f"{where}: key 'force_arch' has unknown value {value!r}; "
                                  f"accepted values: {list(ARCH_FAMILIES)}")
            out[key] = value
        elif key == "log_level" and defaults:
            if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
                raise ConfigError(f"{where}: key 'log_level' has unknown value {value!r}; "
                                  f"accepted values: {list(LOG_LEVELS)}")
            out[key] = value.lower()
        elif key in DEFAULTS_ONLY_KEYS:
            raise ConfigError(f"{where}: key {key!r} is only accepted in [defaults]; accepted keys here: {accepted}")
        else:
            raise ConfigError(f"{where}: unknown key {key!r}; accepted keys: {accepted}")
    return out


def parse_config(data: Mapping[str, Any], path: str = "<config>") -> tuple[dict, dict, dict]:
    """Validate a parsed TOML document; returns ``(defaults, arch, model)``."""
    defaults: dict[str, str] = {}
    arch: dict[str, dict[str, str]] = {}
    model: dict[str, dict[str, str]] = {}
    for section, table in data.items():
        if section == "defaults":
            defaults = _parse_section(table, f"{path}: [defaults]", defaults=True)
        elif section == "arch":
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: [arch] must hold [arch.<family>] tables")
            for name, sub in table.items():
                if name not in ARCH_FAMILIES:
                    raise ConfigError(f"{path}: [arch.{name}]: unknown arch family {name!r}; "
                                      f"accepted values: {list(ARCH_FAMILIES)}")
                arch[name] = _parse_section(sub, f"{path}: [arch.{name}]", defaults=False)
        elif section == "model":
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: [model] must hold [model.<HF architecture>] tables")
            for name, sub in table.items():
                model[name] = _parse_section(sub, f"{path}: [model.{name}]", defaults=False)
        elif section in INTEGRATION_SECTIONS:
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: [{section}] must be a table (read by the {section} integration)")
        else:
            kind = "table" if isinstance(table, dict) else "key"
            raise ConfigError(f"{path}: unknown top-level {kind} {section!r}; accepted sections: "
                              f"[defaults], [arch.<family>], [model.<HF architecture>], [sglang], [vllm]")
    return defaults, arch, model


def _read_env() -> tuple[dict[str, str], str | None, str | None]:
    env: dict[str, str] = {}
    for family, var in FAMILY_ENV.items():
        value = os.environ.get(var)
        if value:
            env[family] = _check_family_value(family, value, f"environment variable {var}")
    force = os.environ.get(FORCE_ARCH_ENV) or None
    if force is not None and force not in ARCH_FAMILIES:
        raise ConfigError(f"environment variable {FORCE_ARCH_ENV}: unknown value {force!r}; "
                          f"accepted values: {list(ARCH_FAMILIES)}")
    level = os.environ.get(LOG_LEVEL_ENV) or None
    if level is not None and level.lower() not in LOG_LEVELS:
        raise ConfigError(f"environment variable {LOG_LEVEL_ENV}: unknown value {level!r}; "
                          f"accepted values: {list(LOG_LEVELS)}")
    return env, force, level.lower() if level else None


def _read_toml(path: str) -> dict[str, Any]:
    """The parsed TOML document at ``path``; every way reading it can fail is a :class:`ConfigError`
    naming the file and what a config file must be."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (from {CONFIG_ENV} or --config)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; expected a TOML config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          f"expected a UTF-8 TOML config file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read the config file at ``path`` (default: ``$NSA_BACKEND_CONFIG``, else none) plus the
    environment overrides, and validate both. Raises :class:`ConfigError`."""
    if path is None:
        path = os.environ.get(CONFIG_ENV) or None
    defaults: dict[str, str] = {}
    arch: dict[str, dict[str, str]] = {}
    model: dict[str, dict[str, str]] = {}
    integrations: dict[str, dict[str, Any]] = {}
    path_str = None
    if path is not None:
        path_str = os.fspath(path)
        data = _read_toml(path_str)
        defaults, arch, model = parse_config(data, path_str)
        integrations = {name: data[name] for name in INTEGRATION_SECTIONS if name in data}
    env, env_force, env_level = _read_env()
    force, force_source = None, None
    if env_force is not None:
        force, force_source = env_force, f"env {FORCE_ARCH_ENV}"
    elif "force_arch" in defaults:
        force, force_source = defaults["force_arch"], f"{path_str} [defaults]"
    level = env_level or defaults.get("log_level", "warning")
    family_defaults = {k: v for k, v in defaults.items() if k in FAMILIES}
    return Config(path=path_str, defaults=family_defaults, arch=arch, model=model, env=env,
                  force_arch=force, force_arch_source=force_source, log_level=level, integrations=integrations)


_lock = threading.Lock()
_active: Config | None = None
_explicit_path: str | None = None


def get_config() -> Config:
    """The active configuration (loaded on first use; see :func:`use_config`)."""
    global _active
    cfg = _active
    if cfg is None:
        with _lock:
            if _active is None:
                _active = load_config(_explicit_path)
                _apply_log_level(_active)
            cfg = _active
    return cfg


def use_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path`` (or re-read ``$NSA_BACKEND_CONFIG`` and the environment when ``None``), make it
    the active configuration and drop cached routing decisions."""
    global _active, _explicit_path
    cfg = load_config(path)
    with _lock:
        _explicit_path = os.fspath(path) if path is not None else None
        _active = cfg
    _apply_log_level(cfg)
    settings_changed()
    return cfg


def reset_config() -> None:
    """Forget the active configuration; the next use re-reads the environment."""
    global _active, _explicit_path
    with _lock:
        _active = None
        _explicit_path = None
    settings_changed()


def _apply_log_level(cfg: Config) -> None:
    logger.setLevel(cfg.log_level.upper())


def _forced_arch() -> str | None:
    return get_config().force_arch


# The kernels tune launches for a forced arch; they read it through ``nsa_backend._settings``.
set_forced_arch_source(_forced_arch)
