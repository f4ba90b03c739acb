"""Ahead-of-time compilation of our Triton kernels for GPUs that are not present.

Used by the tests (and ``nsa-backend doctor``) to prove that every kernel and every launch
configuration compiles for each target architecture and fits its shared-memory budget, without
a GPU: ``triton.compile`` lowers to PTX and runs ``ptxas`` for the requested ``sm_XY``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Architectures we ship kernels for, as compute capabilities (major * 10 + minor).
TARGET_ARCHS: tuple[int, ...] = (80, 86, 89, 90, 100, 120, 121)

# Dynamic shared memory a block may use, in bytes (the opt-in maximum per block).
SHARED_MEMORY_LIMIT: dict[int, int] = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
    121: 99 * 1024,
}

# Architectures with e4m3 support in Triton (fp8e4nv); older ones read fp8 bytes as uint8.
FP8_NATIVE_MIN_ARCH = 89


@dataclass(frozen=True)
class CompiledKernel:
    """What the compiler reports for one kernel, one configuration, one architecture."""

    name: str
    arch: int
    shared_bytes: int
    num_warps: int
    num_stages: int

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY_LIMIT[self.arch]


def compile_for_arch(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: Sequence[str] = (),
) -> CompiledKernel:
    """Compile a ``@triton.jit`` kernel for ``sm_<arch>`` and report its resource use.

    Parameters
    ----------
    kernel : triton.runtime.JITFunction
        The kernel (not under ``TRITON_INTERPRET=1``, which replaces kernels by interpreters).
    signature : dict
        Triton type of every parameter, e.g. ``{"q_ptr": "*fp8e4nv", "n": "i32", "BLOCK": "constexpr"}``.
    constexprs : dict
        Values of the ``constexpr`` parameters.
    arch : int
        Compute capability, e.g. ``120`` for ``sm_120``.
    aligned : sequence of str
        Parameters the runtime would specialise as divisible by 16 (pointers from the caching
        allocator, strides and sizes that are multiples of 16). Without these hints Triton pipelines
        no load, and the reported shared memory is far below what the JIT-compiled kernel uses.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("compile_for_arch needs TRITON_INTERPRET unset (kernels are interpreted otherwise)")
    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap @triton.autotune / @triton.heuristics
        fn = fn.fn
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return CompiledKernel(name=fn.__name__, arch=arch, shared_bytes=int(compiled.metadata.shared),
                          num_warps=num_warps, num_stages=num_stages)
