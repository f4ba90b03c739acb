"""When the Gluon kernels (Triton's lower-level dialect) may run instead of the ``tl`` kernels.

Gluon exposes what plain ``triton.language`` hides: tensors placed in shared memory by hand,
asynchronous copies into it, mbarriers and warpgroup MMAs that read both operands from shared
memory. The sparse-MLA kernels use it on sm_90 where it pays off.

Its API is experimental and changes between Triton releases, so a Gluon kernel runs only when

- the installed Triton is at least ``GLUON_MIN_TRITON`` (the releases the kernels are tested on),
- the launch is on a real CUDA device of an arch the kernel was written for (never in the CPU
  interpreter, which does not run Gluon),
- ``NSA_BACKEND_GLUON`` is not ``0`` (set it to ``0`` to force the ``tl`` kernels everywhere).

Everything else takes the ``tl`` kernels, which remain the reference Triton path.
"""

from __future__ import annotations

import functools

import triton

from nsa_backend import envs
from nsa_backend._settings import env_switch

# Oldest Triton release whose Gluon API the kernels are written against.
GLUON_MIN_TRITON: tuple[int, int] = (3, 6)


def _version(text: str) -> tuple[int, int]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    major, minor = [*parts, 0, 0][:2]
    return major, minor


@functools.cache
def gluon_importable() -> bool:
    """True when this Triton is recent enough and ``triton.experimental.gluon`` imports."""
    if _version(triton.__version__) < GLUON_MIN_TRITON:
        return False
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except Exception:  # any failure means: use the tl kernels
        return False
    return True


def gluon_enabled(arch: int | None, archs: tuple[int, ...]) -> bool:
    """True when a Gluon kernel written for ``archs`` may launch for ``arch``.

    Parameters
    ----------
    arch : int or None
        Capability of the launch (``major * 10 + minor``, from ``device_arch``); ``None`` off CUDA.
    archs : tuple of int
        Capabilities the Gluon kernel supports.
    """
    if arch is None or arch not in archs or envs.triton_interpret():
        return False
    if not env_switch(envs.GLUON, True):
        return False
    return gluon_importable()


if gluon_importable():
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy as _async_copy
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

    # Names that Triton 3.7 changed, bound once for every Gluon kernel:
    # the cp.async copy of a pointer tensor into shared memory (``async_copy_global_to_shared`` ->
    # ``async_load``), the TMA copy of a descriptor's box into shared memory (same rename) and the
    # CTA-wide barrier (``thread_barrier`` -> ``barrier``).
    cp_async = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
    tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
    cta_barrier = getattr(_gl, "barrier", None) or _gl.thread_barrier
