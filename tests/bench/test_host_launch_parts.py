"""``bench/host_launch_parts.py`` without a GPU: one line naming what is missing (exit 2), nothing timed."""

from __future__ import annotations

import pytest
import torch

from tests.bench._scripts import load_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_refuses_without_a_gpu(capsys):
    assert load_script("host_launch_parts").main() == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "Traceback" not in err
