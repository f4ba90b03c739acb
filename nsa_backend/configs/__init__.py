"""Launch configurations of the Triton kernels, one module per op family, kept as data.

Families whose tiles live in shared memory filter their candidate tables with
:func:`shared_memory_budget` and :func:`first_fitting`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT, TARGET_ARCHS

C = TypeVar("C")

# Used when the architecture is unknown (CPU interpreter): the smallest budget we ship for.
FALLBACK_SHARED_MEMORY = min(SHARED_MEMORY_LIMIT[a] for a in TARGET_ARCHS)


def shared_memory_budget(arch: int | None) -> int:
    """Bytes of shared memory a program may use on ``sm_<arch>`` (``None``: the smallest we ship for)."""
    if arch is None:
        return FALLBACK_SHARED_MEMORY
    return SHARED_MEMORY_LIMIT.get(arch, FALLBACK_SHARED_MEMORY)


def first_fitting(
    candidates: Sequence[C], arch: int | None, margin: float, estimate: Callable[[C], int]
) -> C:
    """The first of ``candidates`` (best first) whose ``estimate`` fits ``margin`` of the budget of
    ``sm_<arch>``; the last one when none does."""
    budget = shared_memory_budget(arch) * margin
    return next((c for c in candidates if estimate(c) <= budget), candidates[-1])
