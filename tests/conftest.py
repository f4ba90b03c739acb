"""Shared test setup.

- Without a CUDA GPU, Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET=1`` must be
  set before any kernel module is imported, so it is set here (tests that compile ahead of time
  run in a subprocess without it). ``CUDA_VISIBLE_DEVICES`` is emptied too: vLLM, imported later
  by the integration tests, then keeps real Triton (on a machine without a GPU driver it would
  put placeholders in its place) so its own kernels run in the interpreter.
- ``gpu``-marked tests are skipped without a CUDA GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest

from nsa_backend import routing
from nsa_backend.routing import config

HAS_GPU = torch.cuda.is_available()
# Settings of the framework integrations read from the environment (their own config tables).
INTEGRATION_ENV = ("NSA_BACKEND_SGLANG_TAKEOVER", "NSA_BACKEND_VLLM_TAKEOVER", "NSA_BACKEND_VLLM_INDEXER",
                   "NSA_BACKEND_VLLM_HC_PRENORM")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def routing_isolated(monkeypatch):
    """No nsa-backend setting from the environment, and fresh routing state before and after."""
    for var in (config.CONFIG_ENV, config.FORCE_ARCH_ENV, config.LOG_LEVEL_ENV, *config.FAMILY_ENV.values(),
                *INTEGRATION_ENV):
        monkeypatch.delenv(var, raising=False)
    routing.reset_config()
    routing.set_native_status(None)
    yield
    routing.reset_config()
    routing.set_native_status(None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
