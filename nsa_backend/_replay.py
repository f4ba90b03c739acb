"""Replay of an eager call's allocations and kernel launches, per call signature.

The decode-path ops run once per layer per decode step. Outside a CUDA graph (``--enforce-eager``,
a framework that does not capture an op) each call pays its Python work: argument checks, routing,
launch planning and Triton's argument binding, which together take longer on the host than the
kernels take on the GPU at decode sizes. Yet all of that work depends on the call's *signature*
only: per tensor its shape, strides, dtype, device and address modulo 16; every other argument by
type and value; the current device. Nothing reads tensor values on the host.

:class:`ReplayCache` therefore runs the first call of a signature normally while recording it:

- every tensor operation, through a ``TorchDispatchMode``: allocations are kept, views pass, any
  other operation (a copy, a fill, a host read) makes the signature unreplayable;
- every launch made through :class:`nsa_backend.kernels._launch.CachedLauncher` (its compiled kernel,
  grid and arguments), and the number of Triton launches of any kind (a launch Triton made outside a
  ``CachedLauncher`` makes the signature unreplayable).

Every tensor a kernel received must start at the address of exactly one input or allocation, every other
kernel argument must be a plain scalar (an object such as a TMA descriptor holds the first call's
addresses), and the call must return allocations. Then a later call with the same signature allocates
the same buffers and launches the same compiled kernels, with its own tensors in place of the first
call's, and does nothing else. Signatures that do not qualify keep taking the ordinary path. Only the
``triton`` implementation is recorded (natives and the reference are other code), only on CUDA tensors
of class ``torch.Tensor``, never while ``torch.compile`` traces, and only while cached launches are on
(``NSA_BACKEND_FAST_LAUNCH``, no profiler's launch hook). A change of configuration
(:func:`nsa_backend._settings.settings_changed`) drops every recorded call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa_backend import envs
from nsa_backend._settings import on_settings_change
from nsa_backend.kernels._launch import (
    count_triton_launches,
    fast_launch_enabled,
    record_launches,
    run_compiled,
)

# Signatures kept per op; beyond this the cache starts over (a served model has few).
MAX_SIGNATURES = 256
# Implementations whose calls are recorded: only launches through CachedLauncher replay.
REPLAYED_IMPLS = frozenset({"triton"})

# Argument types keyed by value, and kernel arguments replayed as recorded (a tensor is taken per call;
# anything else is refused).
_SCALARS = frozenset({int, float, bool, str})

_aten = torch.ops.aten
_ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                          _aten.new_empty.default, _aten.new_empty_strided.default})
# Operations that create a view: what they return starts at an address the mapping below resolves, or
# the signature is refused there.
_VIEWS = frozenset({_aten.view, _aten._unsafe_view, _aten.unsqueeze, _aten.squeeze, _aten.as_strided,
                    _aten.alias, _aten.detach, _aten.expand, _aten.permute, _aten.transpose, _aten.t,
                    _aten.select, _aten.slice})
_UNREPLAYABLE = object()


def signature(values: tuple[Any, ...], cuda: bool = True) -> tuple[Any, ...] | None:
    """What a call's work depends on, or ``None`` when the call is not recorded: its first value (the op's
    main tensor) is no CUDA tensor (a CPU tensor with ``cuda=False``), or a value is of a type not keyed
    here (a tensor subclass, a sequence)."""
    first = values[0]
    if first.__class__ is not torch.Tensor or first.is_cuda is not cuda:
        return None
    key: list[Any] = [torch.cuda.current_device() if cuda else None, envs.get(envs.GLUON)]
    append = key.append
    for value in values:
        cls = value.__class__
        if cls is torch.Tensor:
            append((value.shape, value.stride(), value.dtype, value.device, value.data_ptr() & 15))
        elif value is None or cls in _SCALARS:
            append((cls, value))  # the class keeps 1, 1.0 and True apart
        else:
            return None
    return tuple(key)


class _RecordTensorOps(TorchDispatchMode):
    """Keeps the tensors allocated under it and notes any operation other than an allocation or a view."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.other: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        elif func.overloadpacket not in _VIEWS:
            self.other.append(str(func))
        return out


class _ReplayedLaunch:
    """One kernel launch of a replay: the arguments of the recorded launch, with this call's tensors (its
    inputs, then its allocations: the slots) where the recorded launch had tensors."""

    __slots__ = ("args", "compiled", "device", "grid", "slots")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], device: int, args: list[Any],
                 slots: tuple[tuple[int, int], ...]) -> None:
        self.compiled, self.grid, self.device, self.args, self.slots = compiled, grid, device, args, slots

    def __call__(self, slots: list[Any]) -> None:
        args = self.args.copy()
        for position, slot in self.slots:
            args[position] = slots[slot]
        run_compiled(self.compiled, self.grid, self.device, args)


class Replay:
    """The allocations and launches of one call signature, and which allocations it returns."""

    def __init__(self, allocations: tuple[tuple[Any, ...], ...], launches: tuple[_ReplayedLaunch, ...],
                 outputs: int | tuple[int, ...]) -> None:
        self.allocations, self.launches, self.outputs = allocations, launches, outputs

    def __call__(self, values: tuple[Any, ...]) -> Any:
        slots = list(values)
        for size, stride, dtype, device in self.allocations:
            slots.append(torch.empty_strided(size, stride, dtype=dtype, device=device))
        for launch in self.launches:
            launch(slots)
        outputs = self.outputs
        if outputs.__class__ is int:
            return slots[outputs]
        return tuple([slots[i] for i in outputs])


def _slot_of(tensor: torch.Tensor, slots: list[Any]) -> int | None:
    """The one slot whose tensor starts where ``tensor`` does (``None``: none, or several)."""
    ptr = tensor.data_ptr()
    found = [i for i, value in enumerate(slots) if isinstance(value, torch.Tensor) and value.data_ptr() == ptr]
    return found[0] if len(found) == 1 else None


def _build(values: tuple[Any, ...], result: Any, allocations: list[torch.Tensor], launches: list[Any]) -> Replay | None:
    """The replay of a recorded call, or ``None`` when some tensor cannot be traced to a slot."""
    slots: list[Any] = [*values, *allocations]
    replayed = []
    for launch in launches:
        args = [*launch.args, *launch.tail]
        tensor_slots = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                slot = _slot_of(arg, slots)
                if slot is None:
                    return None
                tensor_slots.append((position, slot))
                args[position] = None
            elif arg is not None and arg.__class__ not in _SCALARS:
                return None  # e.g. a TMA descriptor: it holds the first call's address
        replayed.append(_ReplayedLaunch(launch.compiled, launch.grid, launch.device, args, tuple(tensor_slots)))
    outputs = result if isinstance(result, tuple) else (result,)
    indices = []
    for out in outputs:
        # the tensor returned is another Python object than the one the dispatch mode saw: match what it is
        found = [i for i, t in enumerate(allocations)
                 if isinstance(out, torch.Tensor) and t.data_ptr() == out.data_ptr() and t.shape == out.shape
                 and t.stride() == out.stride() and t.dtype == out.dtype]
        if len(found) != 1:
            return None
        indices.append(len(values) + found[0])
    shapes = tuple((t.shape, t.stride(), t.dtype, t.device) for t in allocations)
    return Replay(shapes, tuple(replayed), tuple(indices) if isinstance(result, tuple) else indices[0])


class ReplayCache:
    """Recorded calls of one public op, per signature (see the module docstring).

    ``values`` is the call's arguments in a fixed order, the tensors among them the ones the kernels
    receive (views of them are resolved by address).

    >>> key = cache.key(values)            # None: this call is never recorded
    >>> if (replay := cache.get(key)) is not None:
    ...     return replay(values)
    >>> ...  # checks and routing
    >>> return cache.run(key, values, impl_name, lambda: the_call())
    """

    def __init__(self, op: str, cuda: bool = True) -> None:
        self.op = op
        self.cuda = cuda  # False only in tests of the recording itself (CPU tensors, stand-in kernels)
        self._calls: dict[Any, Any] = {}
        on_settings_change(self.clear)

    def clear(self) -> None:
        self._calls.clear()

    def __len__(self) -> int:
        return sum(1 for plan in self._calls.values() if plan is not _UNREPLAYABLE)

    def key(self, values: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The call's signature, or ``None`` when it is never recorded (tracing, launches not cached)."""
        if torch.compiler.is_compiling() or not fast_launch_enabled():
            return None
        return signature(values, self.cuda)

    def get(self, key: tuple[Any, ...] | None) -> Replay | None:
        """The replay of ``key``'s signature, if one was recorded."""
        if key is None:
            return None
        plan = self._calls.get(key)
        return None if plan is _UNREPLAYABLE else plan

    def run(self, key: tuple[Any, ...] | None, values: tuple[Any, ...], impl: str, call: Callable[[], Any]) -> Any:
        """``call()``, recorded for ``key`` when it is the first call of a replayable signature."""
        if key is None or impl not in REPLAYED_IMPLS or key in self._calls:
            return call()
        mode = _RecordTensorOps()
        with count_triton_launches() as counter, record_launches() as launches, mode:
            result = call()
        plan = None
        if not mode.other and None not in launches and counter.count == len(launches):
            plan = _build(values, result, mode.allocations, launches)
        if len(self._calls) >= MAX_SIGNATURES:
            self._calls.clear()
        self._calls[key] = plan if plan is not None else _UNREPLAYABLE
        return result

