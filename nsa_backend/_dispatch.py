"""Which implementations exist for each public op, and how a call picks one.

The table is data (:mod:`nsa_backend.routing.implementations`, which routing reads too):
``IMPLEMENTATIONS[op][impl]`` is a ``"module:function"`` path imported here on first use, so native
packages and Triton are only imported when a call needs them. Every
implementation function takes the public op's parameters (without ``impl``), already validated.

``impl="auto"`` is resolved by :func:`nsa_backend.routing.select_impl` from the device, the shape
and the user's configuration; an explicit name is checked against the same capability table.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from nsa_backend.routing.implementations import (
    FORMAT_IMPLEMENTATIONS,
    IMPL_NAMES,
    IMPLEMENTATIONS,
    available_impls,
)
from nsa_backend.routing.router import select_impl

__all__ = [
    "FORMAT_IMPLEMENTATIONS",
    "IMPLEMENTATIONS",
    "IMPL_NAMES",
    "available_impls",
    "custom_op",
    "get_impl",
    "resolve_impl",
]

def custom_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the torch custom op ``name`` and return a caller that uses the op only when
    tracing (``torch.compile``), and calls ``fn`` directly in eager mode.

    Both paths run the same function; skipping the dispatcher in eager mode removes tens of
    microseconds of host time per call, which matters for decode steps run outside CUDA graphs.
    The returned caller exposes ``register_fake`` and the registered op as ``.op``.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.register_fake = op.register_fake  # type: ignore[attr-defined]
        call.op = op  # type: ignore[attr-defined]
        return call

    return wrap


@functools.cache
def get_impl(op: str, impl: str, kv_format: str | None = None) -> Callable[..., Any]:
    """The function implementing ``op`` with ``impl`` (imported on first use); with ``kv_format``, the
    function of :data:`FORMAT_IMPLEMENTATIONS` for that input format."""
    if kv_format is not None:
        table = FORMAT_IMPLEMENTATIONS[(op, kv_format)]
        if impl not in table:
            raise ValueError(f"{op}: impl={impl!r} has no kernel for kv_format {kv_format!r}; "
                             f"available: {list(table)}")
        module, func = table[impl].split(":")
        return getattr(importlib.import_module(module), func)
    module, func = IMPLEMENTATIONS[op][impl].split(":")
    return getattr(importlib.import_module(module), func)


def resolve_impl(op: str, impl: str, features: dict[str, Any]) -> str:
    """Validate the name ``impl`` for ``op`` and resolve it with :func:`nsa_backend.routing.select_impl`.

    ``features`` carries ``device`` plus the shape features the capability table looks at.
    """
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected a str, one of {list(IMPL_NAMES)}, got {type(impl).__name__}")
    if impl not in IMPL_NAMES:
        raise ValueError(f"impl: expected one of {list(IMPL_NAMES)}, got {impl!r}")
    if impl != "auto" and impl not in IMPLEMENTATIONS[op]:
        raise ValueError(f"impl: {op} has no {impl!r} implementation; available: "
                         f"{['auto', *IMPLEMENTATIONS[op]]}")
    # Routing checks the rest (CPU tensors, the interpreter, installed kernels, natives, shapes).
    return select_impl(op, impl, features)
