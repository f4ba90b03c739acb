"""Values that routing owns and the lower layers read.

Imports point one way: public ops -> ``_dispatch`` -> ``routing`` -> ``kernels`` / ``native``. A few things
routing decides are still needed lower down:

- the arch family a Triton launch is tuned for when routing is forced to one (``NSA_BACKEND_FORCE_ARCH`` or
  ``force_arch`` in the config file), read by ``nsa_backend.kernels._arch.device_arch``;
- the head count a native package accepts for a call (heads are zero-padded up to it), read by the
  wrappers of ``nsa_backend.native``;
- the error class of a bad setting, raised by routing's config and by the kernels' on/off switches
  (:func:`env_switch`);
- the caches built from settings, dropped when a setting changes.

This module imports no other nsa_backend module but ``envs``, so every layer can import it. Routing installs
the source of each value when its modules are imported (``nsa_backend/__init__.py`` imports them before any
kernel can run); until then the forced arch is read from the environment alone and no heads are padded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nsa_backend import envs


class ConfigError(ValueError):
    """A config file or environment variable holds an unknown section, key or value."""


_SWITCH_VALUES: dict[str, bool] = {"1": True, "true": True, "on": True, "yes": True,
                                   "0": False, "false": False, "off": False, "no": False}


def env_switch(name: str, default: bool) -> bool:
    """The on/off environment variable ``name`` (``default`` when unset or empty); any other value than
    0/1/true/false/on/off/yes/no is a :class:`ConfigError` naming the variable."""
    value = envs.get(name)
    if value is None:
        return default
    switch = _SWITCH_VALUES.get(value.strip().lower())
    if switch is None:
        raise ConfigError(f"{name} must be one of 0/1/true/false/on/off/yes/no, got {value!r}")
    return switch


def _forced_arch_from_env() -> str | None:
    return envs.get(envs.FORCE_ARCH)


def _no_padding(op: str, impl: str, num_heads: int, device: Any) -> int:
    return num_heads


_forced_arch_source: Callable[[], str | None] = _forced_arch_from_env
_padded_heads_source: Callable[[str, str, int, Any], int] = _no_padding
_cache_clearers: list[Callable[[], None]] = []


def set_forced_arch_source(source: Callable[[], str | None]) -> None:
    """Install the function that returns the forced arch family (routing's active configuration)."""
    global _forced_arch_source
    _forced_arch_source = source


def forced_arch() -> str | None:
    """The arch family routing is forced to (``"sm120"``, ...), or ``None`` to use the GPU's own."""
    return _forced_arch_source()


def set_padded_heads_source(source: Callable[[str, str, int, Any], int]) -> None:
    """Install ``source(op, impl, num_heads, device) -> heads``, the head count ``impl`` runs ``op`` with."""
    global _padded_heads_source
    _padded_heads_source = source


def padded_heads(op: str, impl: str, num_heads: int, device: Any = None) -> int:
    """Head count native implementation ``impl`` needs for ``num_heads`` real heads of ``op`` on ``device``
    (``num_heads`` itself when no padding is needed or possible)."""
    return _padded_heads_source(op, impl, num_heads, device)


def on_settings_change(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear`` to run whenever :func:`settings_changed` is called; returns ``clear``."""
    if clear not in _cache_clearers:
        _cache_clearers.append(clear)
    return clear


def settings_changed() -> None:
    """Drop every registered cache (after the configuration, the environment or the native probe changed)."""
    for clear in list(_cache_clearers):
        clear()
