"""``bench/host_launch_parts.py`` without a GPU: one line naming what is missing (exit 2), nothing timed."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "host_launch_parts.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_refuses_without_a_gpu(capsys):
    spec = importlib.util.spec_from_file_location("host_launch_parts", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "Traceback" not in err
