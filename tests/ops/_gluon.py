"""Where the Gluon kernel tests can run: the CPU compile checks need a Triton with the Gluon dialect the
kernels are written for; the GPU tests also need an sm_90 device."""

from __future__ import annotations

import torch


def gluon_available() -> bool:
    """Whether this Triton has the Gluon dialect the kernels are written for."""
    from nsa_backend.kernels._gluon import gluon_importable

    return gluon_importable()


def on_sm90_gluon() -> bool:
    """A CUDA sm_90 device and a Triton with Gluon: where the Gluon kernels run."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and gluon_available()
