"""Repeat launches of a Triton kernel without Triton's per-call binding.

``kernel[grid](*args, **kwargs)`` binds every argument, specialises it, builds a cache key and looks
the compiled kernel up on every call: tens of microseconds of host time, paid per layer by every
eager decode step. :class:`CachedLauncher` keeps, per call signature, the compiled kernel and the
values of the parameters that follow the positional arguments (constexprs, defaults, heuristics), and
launches that compiled kernel directly on a later call with the same signature.

The signature holds everything Triton specialises on, or more: per tensor its dtype and whether its
address is 16-byte aligned; per int whether it is 1, divisible by 16 and which integer type holds it;
floats by type; ``None`` and bools by value; the keyword arguments (constexprs and launch options) by
value; the heuristics' values; the current device. A call Triton would compile differently therefore
never reuses a kernel. The first call of a signature, calls with arguments of other types, the CPU
interpreter and Triton's launch hooks (profilers) take Triton's own path.

:func:`record_launches` collects the launches made through a :class:`CachedLauncher` while a call runs, and
:func:`count_triton_launches` counts every Triton launch meanwhile: ``nsa_backend._replay`` builds its replays
of whole eager calls from them.

On unless ``NSA_BACKEND_FAST_LAUNCH=0``. Measured in one process on an H200 (sm120 proxy), a cached
launch took 27 / 17 / 21 us against Triton's 46 / 26 / 29 us (sparse decode kernel, its split merge, paged
logits; bench/results/h200-eager/). The GPU fuzz suites of the indexer, top-k and sparse MLA ops passed
with the cached launches, natively and under the sm120 proxy (bench/results/h100-fuzz/bf041f4/), and
``tests/ops/test_launch.py`` compares them with Triton's own launches on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime.autotuner import Heuristics
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nsa_backend import envs
from nsa_backend._settings import env_switch

# Signatures kept per kernel; beyond this the cache starts over (shapes of a served model are few).
MAX_SIGNATURES = 512
_UNCACHEABLE = object()
# keyword values keyed by value (constexprs and launch options)
_PLAIN = frozenset({type(None), bool, int, float, str})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints, for grids (``triton.cdiv`` is a JIT function: a slower call on the host)."""
    return -(-a // b)


def _arg_key(arg: Any) -> Any:
    """What Triton's specialisation can see of one positional argument (a superset of it)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if arg is None or isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= 2**63)
    if isinstance(arg, float):
        return float
    return _UNCACHEABLE


def _arg_keys(args: tuple[Any, ...], constexpr: tuple[bool, ...]) -> tuple[Any, ...] | None:
    """:func:`_arg_key` of every positional argument, constexprs by value, in one pass (this runs on every
    launch: no call per argument for the common types); ``None`` when one of them cannot be keyed."""
    keys = []
    append = keys.append
    for arg, const in zip(args, constexpr):
        cls = arg.__class__
        if const:
            append(arg)
        elif cls is int:
            append((arg == 1, arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= 2**63))
        elif cls is torch.Tensor:
            append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif arg is None or cls is bool:
            append(arg)
        elif cls is float:
            append(float)
        else:  # subclasses (parameters, int enums) and anything else: the general rule
            key = _arg_key(arg)
            if key is _UNCACHEABLE:
                return None
            append(key)
    return tuple(keys)


def _no_hook(hook: Any) -> bool:
    # Triton < 3.5 keeps None when no hook is set, later versions an empty HookChain (its `calls`)
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def fast_launch_enabled() -> bool:
    """Whether launches may skip Triton's own: ``NSA_BACKEND_FAST_LAUNCH`` is not ``0`` and no launch hook
    (a profiler) is set."""
    # Kernels decorated under TRITON_INTERPRET=1 are no JITFunction and never get here (CachedLauncher._jit).
    return (env_switch(envs.FAST_LAUNCH, True)
            and _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook))


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


class Launch(NamedTuple):
    """One launch as :func:`record_launches` saw it: the compiled kernel (``None`` in the CPU interpreter),
    the grid, the positional arguments, the parameter values bound after them and the CUDA device."""

    compiled: Any
    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    tail: tuple[Any, ...]
    device: int


def run_compiled(compiled: Any, grid: tuple[int, int, int], device: int, args: Sequence[Any]) -> None:
    """Launch ``compiled`` (a kernel Triton compiled) on the current stream of ``device`` with every
    argument given (positional ones and the bound tail), skipping Triton's binding."""
    compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args)


_recorder = threading.local()


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch | None]]:
    """Collect the launches this thread makes through a :class:`CachedLauncher` while the block runs.

    Each launch takes Triton's own path (compiling where needed) and is appended as a :class:`Launch`;
    a launch without a compiled kernel (the CPU interpreter) is appended as ``None``.
    """
    launches: list[Launch | None] = []
    outer = getattr(_recorder, "launches", None)
    _recorder.launches = launches
    try:
        yield launches
    finally:
        _recorder.launches = outer


class _LaunchCounter:
    """A Triton launch-enter hook counting launches of every kernel, in every thread."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, metadata: Any) -> None:
        self.count += 1


@contextlib.contextmanager
def count_triton_launches() -> Iterator[_LaunchCounter]:
    """Count every Triton launch while the block runs (``.count``), also launches that bypass
    :class:`CachedLauncher`. While the hook is set, cached launches take Triton's path (as under a profiler)."""
    counter = _LaunchCounter()
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton >= 3.5: a chain of hooks
        hook.add(counter)
        try:
            yield counter
        finally:
            hook.remove(counter)
        return
    knobs.runtime.launch_enter_hook = counter  # Triton 3.4: one hook, None when unset
    try:
        yield counter
    finally:
        knobs.runtime.launch_enter_hook = hook


@functools.cache
def cached_launcher(kernel: Any) -> CachedLauncher:
    """The one :class:`CachedLauncher` of ``kernel`` (for kernels chosen per call)."""
    return CachedLauncher(kernel)


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)``: the kernel's own launch, with the compiled kernel reused per
    call signature.

    Parameters
    ----------
    kernel : triton.runtime.JITFunction or triton.runtime.autotuner.Heuristics
        A ``@triton.jit`` kernel, possibly under ``@triton.heuristics`` (not ``@triton.autotune``, whose
        choice depends on more than the signature).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._heuristics: dict[str, Callable[[dict[str, Any]], Any]] = {}
        fn = kernel
        while isinstance(fn, Heuristics):
            self._heuristics.update(fn.values)
            fn = fn.fn
        # Under TRITON_INTERPRET=1 kernels are interpreted functions: always Triton's own path then.
        self._jit = isinstance(fn, JITFunction)
        params = fn.params if self._jit else []
        self._params = [(p.name, p.default) for p in params]
        # constexprs passed positionally are keyed by value, like the keyword ones
        self._constexpr = tuple(p.is_constexpr for p in params)
        self._arg_names = [name for name, _ in self._params]
        self._plans: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        if getattr(_recorder, "launches", None) is not None:
            return functools.partial(self._record, grid)
        if not (self._jit and fast_launch_enabled()):  # Triton's own launch, nothing in between
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def _record(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        compiled = self.kernel[grid](*args, **kwargs)
        if not self._jit or compiled is None:
            _recorder.launches.append(None)
            return
        _recorder.launches.append(Launch(compiled, _grid3(grid), args, self._tail(args, kwargs),
                                         torch.cuda.current_device()))

    def _launch(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        key = self._key(args, kwargs)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None:
                if len(self._plans) >= MAX_SIGNATURES:
                    self._plans.clear()
                self._plans[key] = (compiled, self._tail(args, kwargs))
            return
        compiled, tail = plan
        run_compiled(compiled, _grid3(grid), key[0], (*args, *tail))

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any | None:
        arg_keys = _arg_keys(args, self._constexpr)
        if arg_keys is None:
            return None
        for value in kwargs.values():
            if value.__class__ not in _PLAIN:
                return None
        heuristics = ()
        if self._heuristics:
            named = dict(zip(self._arg_names, args))
            named.update(kwargs)
            heuristics = tuple([heur(named) for heur in self._heuristics.values()])
        # keywords in the order of the call: a call site passes them in one order; another order is
        # another signature (compiled once more by Triton, never a wrong kernel)
        return (torch.cuda.current_device(), arg_keys, tuple(kwargs.items()), heuristics)

    def _tail(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Values of the parameters after the positional ones, as Triton binds them for this signature."""
        named = {**dict(zip(self._arg_names, args)), **kwargs}
        extra = {name: heur(named) for name, heur in self._heuristics.items()}
        tail = []
        for name, default in self._params[len(args):]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in extra:
                tail.append(extra[name])
            else:
                tail.append(default)
        return tuple(tail)
