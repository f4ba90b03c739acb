"""The standalone scripts of ``bench/`` imported as modules by their tests (they are no package)."""

from __future__ import annotations

import importlib.util
import pathlib
import types

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> types.ModuleType:
    """``bench/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
