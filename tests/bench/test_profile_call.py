"""``bench/profile_call.py``: its usage errors name the option (exit 2, no traceback) before anything runs; on a
GPU each op's call runs between the profiler marks."""

from __future__ import annotations

import pytest
import torch

from tests.bench._scripts import load_script


@pytest.fixture(scope="module")
def profile_call():
    return load_script("profile_call")


@pytest.mark.parametrize("argv, words", [
    (["prefill", "--h-q", "0"], "argument --h-q: expected a positive integer, got '0'"),
    (["decode", "--b", "x"], "argument --b: expected a positive integer, got 'x'"),
    (["decode", "--kv", "fp16"], "argument --kv: invalid choice"),
    (["attention"], "argument op: invalid choice"),
])
def test_usage_errors_name_the_option(profile_call, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        profile_call.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["paged", "--context", "100"], "--context: expected a multiple of 64"),
    (["prefill", "--s-kv", "1024"], "--topk: expected at most --s-kv (1024), got 2048"),
    (["decode", "--topk", "9000"], "--topk: expected at most 8192"),
    (["mhc", "--proxy", "sm75"], "--proxy: expected one of"),
])
def test_bad_shapes_are_refused_before_the_gpu_is_asked_for(profile_call, capsys, argv, words):
    assert profile_call.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["prefill", "--s-q", "2", "--s-kv", "256", "--h-q", "16", "--topk", "64"],
    ["decode", "--b", "1", "--h-q", "16", "--topk", "64"],
    ["decode", "--b", "1", "--h-q", "16", "--topk", "64", "--kv", "bf16"],
    ["paged", "--b", "1", "--context", "128", "--heads", "16"],
    ["mhc", "--m", "16"],
])
def test_the_profiled_call_is_the_op_on_the_suites_inputs(profile_call, argv):
    """The arguments the script builds are a valid call of the op: its Triton kernels (the interpreter without a
    GPU) give the reference's results on them."""
    args = profile_call.parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    op, kwargs = profile_call.op_arguments(args, device)
    results = []
    for impl in ("triton", "reference"):
        out = op(**kwargs, impl=impl)
        if out is None:  # the mHC GEMM writes d and sqr_sum
            out = (kwargs["d"].clone(), kwargs["sqr_sum"].clone())
        results.append(out if isinstance(out, tuple) else (out,))
    for got, want in zip(*results, strict=True):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite].float(), want[finite].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_refuses_without_a_gpu(profile_call, capsys):
    assert profile_call.main(["decode"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


class _MarkedCudart:
    """The CUDA runtime's profiler marks, noted in ``events`` before they are passed on."""

    def __init__(self, cudart, events: list[str]) -> None:
        self.cudart, self.events = cudart, events

    def cudaProfilerStart(self):
        self.events.append("start")
        return self.cudart.cudaProfilerStart()

    def cudaProfilerStop(self):
        self.events.append("stop")
        return self.cudart.cudaProfilerStop()


@pytest.mark.gpu
@pytest.mark.parametrize("argv", [
    ["prefill", "--s-q", "8", "--s-kv", "4096", "--h-q", "64", "--topk", "512"],
    ["decode", "--b", "2", "--h-q", "16", "--topk", "256"],
    ["decode", "--b", "2", "--h-q", "64", "--topk", "256", "--kv", "bf16"],
    ["paged", "--b", "2", "--context", "4096"],
    ["mhc", "--m", "256"],
])
def test_each_op_is_profiled_once(profile_call, monkeypatch, argv):
    """The warm-up calls, then exactly one call between the profiler's start and stop marks."""
    events: list[str] = []
    build_call = profile_call.build_call

    def noted_call(*args):
        call = build_call(*args)

        def run():
            events.append("call")
            return call()

        return run

    monkeypatch.setattr(profile_call, "build_call", noted_call)
    marked = _MarkedCudart(torch.cuda.cudart(), events)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: marked)
    assert profile_call.main([*argv, "--warmup", "2"]) == 0
    assert events == ["call", "call", "start", "call", "stop"]
