"""The architecture a kernel launch is tuned for: the GPU's own, or the one routing is forced to.

With ``NSA_BACKEND_FORCE_ARCH`` (or ``force_arch`` in the config file) the Triton launchers pick
the launch configurations of the forced arch, e.g. the ~99 KiB shared-memory tiles of sm_120 on
an H200, so that arch's route runs end to end on the GPU at hand (the kernel source is the same;
Triton compiles it for the real GPU).
"""

from __future__ import annotations

import functools

import torch

from nsa_backend._settings import forced_arch

# Compute capability (major * 10 + minor) standing for each arch family.
FAMILY_CAPABILITY: dict[str, int] = {
    "sm80": 80, "sm86": 86, "sm89": 89, "sm90": 90, "sm100": 100, "sm103": 103, "sm120": 120, "sm121": 121,
}


@functools.cache
def _real(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_arch(device: torch.device) -> int | None:
    """Capability the launch is tuned for (``None`` off CUDA, e.g. in the CPU interpreter)."""
    if device.type != "cuda":
        return None
    forced = FAMILY_CAPABILITY.get(forced_arch() or "")
    return forced if forced is not None else device_capability(device)


def device_capability(device: torch.device) -> int | None:
    """Capability of the GPU itself, whatever arch routing is forced to (``None`` off CUDA): for what the
    compiled code may use, e.g. instructions from sm_90 on."""
    if device.type != "cuda":
        return None
    return _real(_index(device))[0]


def device_sms(device: torch.device, off_cuda: int = 4) -> int:
    """Number of streaming multiprocessors of the real GPU; ``off_cuda`` off CUDA (the CPU interpreter)."""
    if device.type != "cuda":
        return off_cuda
    return _real(_index(device))[1]
