"""Isolation for routing tests: no NSA_BACKEND_* variables, fresh config, real native probe."""

from __future__ import annotations

import pytest

from nsa_backend import routing
from nsa_backend.routing import capabilities, config, router

NSA_VARS = (config.CONFIG_ENV, config.FORCE_ARCH_ENV, config.LOG_LEVEL_ENV, *config.FAMILY_ENV.values())

ALL_NATIVES = {
    "deep_gemm": capabilities.NativeStatus("deep_gemm", True, "2.6.1"),
    "flash_mla": capabilities.NativeStatus("flash_mla", True, "1.0.0"),
    "flashinfer": capabilities.NativeStatus("flashinfer", True, "0.7.2"),
}


@pytest.fixture(autouse=True)
def clean_routing(monkeypatch):
    for var in NSA_VARS:
        monkeypatch.delenv(var, raising=False)
    routing.reset_config()
    routing.set_native_status(None)
    routing.set_active_model(None)
    yield
    routing.reset_config()
    routing.set_native_status(None)
    routing.set_active_model(None)


@pytest.fixture
def all_kernels_present(monkeypatch):
    """Pretend every implementation module of the dispatch table is installed (Triton included)."""
    from nsa_backend.routing import implementations

    monkeypatch.setattr(implementations, "available_impls", lambda op: list(implementations.IMPLEMENTATIONS[op]))
    router._implemented.cache_clear()
    yield
    router._implemented.cache_clear()


@pytest.fixture
def natives():
    """Every native package importable at a current version."""
    routing.set_native_status(ALL_NATIVES)
    return ALL_NATIVES
