"""A stand-in for a launcher that records each launch instead of running it, for CPU tests of what a launcher
passes to a kernel (grid, arguments by the kernel's parameter names, compile-time options)."""

from __future__ import annotations

from typing import Any

import torch


class LaunchRecorder:
    """``recorder[grid](*args, **options)`` appends ``(grid, {parameter: positional arg}, options)`` to
    ``launches`` (options: the compile-time arguments and launch options); every parameter must get a value."""

    def __init__(self, kernel: Any) -> None:
        self.names: list[str] = list(kernel.arg_names)
        self.launches: list[tuple[tuple[int, ...], dict[str, Any], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: Any, **options: Any) -> None:
            by_name = dict(zip(self.names, args))
            missing = [n for n in self.names if n not in by_name and n not in options]
            assert len(args) <= len(self.names) and not missing, f"parameters without a value: {missing}"
            self.launches.append((tuple(grid), by_name, options))

        return launch


def element_offsets(t: torch.Tensor) -> torch.Tensor:
    """The offset, in elements from ``t``'s first, of every element of ``t`` (its strides applied)."""
    off = torch.zeros(t.shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        off = off + torch.arange(size, dtype=torch.int64).view(shape) * stride
    return off
