"""CPU tensors and the Triton interpreter: ``triton`` chosen by the environment or the config file
runs in the interpreter when ``TRITON_INTERPRET=1`` and falls back to the reference otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

import nsa_backend as nb
from nsa_backend import routing
from nsa_backend.routing import validate

CPU = {"device": torch.device("cpu"), "topk": 4}


def test_env_choice_of_triton_runs_in_the_interpreter(monkeypatch, all_kernels_present):
    monkeypatch.setenv("NSA_BACKEND_TOPK", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    routing.reset_config()
    assert routing.select_impl("topk_indices", "auto", CPU) == "triton"
    decision = routing.decide("topk_indices", "auto", "cpu", {"topk": 4})
    assert decision.source == "env NSA_BACKEND_TOPK" and "interpreter" in decision.reason


def test_config_choice_of_triton_without_interpreter_falls_back(monkeypatch, all_kernels_present, tmp_path, caplog):
    path = tmp_path / "c.toml"
    path.write_text('[defaults]\ntopk = "triton"\n')
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    routing.use_config(path)
    with caplog.at_level(logging.WARNING, logger="nsa_backend"):
        assert routing.select_impl("topk_indices", "auto", CPU) == "reference"
    assert "TRITON_INTERPRET=1" in caplog.text
    # auto on CPU stays the reference even with the interpreter on: only an explicit choice runs it
    routing.reset_config()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert routing.select_impl("topk_indices", "auto", CPU) == "reference"


def test_env_triton_runs_the_kernel_on_cpu_tensors(monkeypatch):
    """End to end: NSA_BACKEND_TOPK=triton with the interpreter computes the reference's answer."""
    pytest.importorskip("triton")
    monkeypatch.setenv("NSA_BACKEND_TOPK", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    routing.reset_config()
    logits = torch.randn(3, 40)
    got = nb.topk_indices(logits, 8)
    want = nb.topk_indices(logits, 8, impl="reference")
    assert routing.select_impl("topk_indices", "auto", {"device": logits.device, "topk": 8, "n": 40}) == "triton"
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


def test_heads_per_gpu_limits():
    args = ("DeepseekV32ForCausalLM", "sm90", "bfloat16")
    validate.validate_impl_choice(*args, "triton_sparse_mla", "auto", heads_per_gpu=32)
    with pytest.raises(validate.ImplChoiceError, match=r"at most 32 attention heads per GPU.*128 per GPU"):
        validate.validate_impl_choice(*args, "triton_sparse_mla", "auto", heads_per_gpu=128)
    with pytest.raises(validate.ImplChoiceError, match="at most 128"):
        validate.validate_impl_choice(*args, "auto", "flashmla_sparse", heads_per_gpu=256)
    # without a head count the matrix alone decides (callers that do not know it)
    validate.validate_impl_choice(*args, "triton_sparse_mla", "auto")
