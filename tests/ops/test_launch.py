"""The compiled-kernel cache of repeated launches (``nsa_backend.kernels._launch``).

CPU: what the signature keys on, and how the parameters after the positional ones are bound (in a
subprocess without the interpreter, where ``@triton.jit`` gives Triton's own kernel objects).
GPU: launches through the cache equal Triton's own launches, also when a call changes what Triton
specialises on (alignment, an int equal to 1 or divisible by 16, a heuristics value).
"""

from __future__ import annotations

import pytest
import torch

from nsa_backend._settings import ConfigError
from nsa_backend.kernels._launch import _UNCACHEABLE, _arg_key, _arg_keys, cdiv, fast_launch_enabled
from tests.ops._aot import run_aot_script


def test_arg_key_tells_apart_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) != _arg_key(base[1:])  # 4-byte offset: no longer 16-byte aligned
    assert _arg_key(base) != _arg_key(base.to(torch.bfloat16))
    assert _arg_key(1) != _arg_key(17)  # 1 is a constexpr to Triton
    assert _arg_key(16) != _arg_key(17)  # divisibility by 16
    assert _arg_key(17) == _arg_key(33)  # neither 1 nor a multiple of 16: one kernel
    assert _arg_key(2**31) != _arg_key(2**31 - 1)  # i64 vs i32
    assert _arg_key(None) != _arg_key(False) and _arg_key(True) != _arg_key(False)
    assert _arg_key(0.5) == _arg_key(2.0)  # floats are runtime fp32 arguments
    assert _arg_key(object()) is _UNCACHEABLE


def test_arg_keys_of_a_launch_equal_the_key_of_each_argument():
    t = torch.zeros(64, dtype=torch.float32)
    param = torch.nn.Parameter(torch.zeros(8))  # a Tensor subclass takes the general rule
    args = (t, t[1:], None, True, False, 1, 16, 17, 2**31, 0.5, param, 64)
    constexpr = (False,) * 11 + (True,)
    assert _arg_keys(args, constexpr) == (*(_arg_key(a) for a in args[:-1]), 64)  # the constexpr by value
    assert _arg_keys((t, object()), (False, False)) is None
    assert _arg_keys((t, object()), (False, True)) is not None  # a constexpr is keyed by value


def test_switch_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("NSA_BACKEND_FAST_LAUNCH", raising=False)
    assert fast_launch_enabled()
    for value, want in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("NSA_BACKEND_FAST_LAUNCH", value)
        assert fast_launch_enabled() is want, value
    monkeypatch.setenv("NSA_BACKEND_FAST_LAUNCH", "fast")
    with pytest.raises(ConfigError, match="NSA_BACKEND_FAST_LAUNCH must be one of 0/1/true/false/on/off/yes/no"):
        fast_launch_enabled()


def test_cdiv():
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 33)] == [0, 1, 1, 1, 2, 3]


_BINDING = r"""
import json, torch, triton, triton.language as tl
from nsa_backend.kernels._launch import CachedLauncher

@triton.heuristics({"HAS_B": lambda args: args["b_ptr"] is not None})
@triton.jit
def k(a_ptr, b_ptr, n, scale, BLOCK: tl.constexpr, MODE: tl.constexpr = 3, HAS_B: tl.constexpr = False):
    pass

launcher = CachedLauncher(k)
a = torch.zeros(4)
out = {
    "tail_kw": list(launcher._tail((a, None, 5, 0.5), {"BLOCK": 64, "num_warps": 4})),
    "tail_b": list(launcher._tail((a, a, 5, 0.5), {"BLOCK": 64, "MODE": 7})),
    "tail_pos": list(launcher._tail((a, None, 5, 0.5, 128), {})),
    "constexpr": list(launcher._constexpr),
}
print(json.dumps(out))
"""


def test_tail_binds_keywords_defaults_and_heuristics_in_parameter_order(tmp_path):
    script = tmp_path / "binding.py"  # @triton.jit needs its source in a file
    script.write_text(_BINDING)
    got = run_aot_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", timeout=300)
    # BLOCK from the keywords (launch options are no parameters), MODE's default, HAS_B from the heuristic
    assert got["tail_kw"] == [64, 3, False]
    assert got["tail_b"] == [64, 7, True]
    assert got["tail_pos"] == [3, False]  # BLOCK given positionally
    assert got["constexpr"] == [False, False, False, False, True, True, True]


@pytest.mark.gpu
def test_cached_launches_equal_tritons_own(monkeypatch):
    import triton
    import triton.language as tl

    from nsa_backend.kernels._launch import CachedLauncher

    @triton.heuristics({"HAS_B": lambda args: args["b_ptr"] is not None})
    @triton.jit
    def axpy(a_ptr, b_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, HAS_B: tl.constexpr = False):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(a_ptr + offs, mask=m, other=0.0) * scale
        if HAS_B:
            x += tl.load(b_ptr + offs, mask=m, other=0.0)
        tl.store(out_ptr + offs, x, mask=m)

    monkeypatch.setenv("NSA_BACKEND_FAST_LAUNCH", "1")
    launcher = CachedLauncher(axpy)
    buf = torch.randn(4096, device="cuda")
    other = torch.randn(4096, device="cuda")
    for n, off, with_b, scale in [(1000, 0, False, 2.0), (1000, 0, False, 3.0), (1000, 1, False, 2.0),
                                  (1, 0, True, 0.5), (1024, 0, True, 0.5), (1024, 3, True, -1.0), (17, 0, False, 1.0)]:
        for _ in range(2):  # the second call of a signature takes the cached path
            a, b = buf[off:off + n], (other[:n] if with_b else None)
            out = torch.full((n,), float("nan"), device="cuda")
            launcher[(triton.cdiv(n, 256),)](a, b, out, n, scale, BLOCK=256)
            want = a * scale + (b if with_b else 0)
            torch.testing.assert_close(out, want)
    # one signature each: n in {1000, 17} aligned without b (the scale is a runtime float), n 1000 misaligned,
    # n 1 with b, n 1024 aligned with b, n 1024 misaligned with b
    assert len(launcher._plans) == 5
