"""Recorded eager calls (``nsa_backend._replay``).

On the CPU the recording is driven with stand-in kernels: a call appends the launches a
``CachedLauncher`` would record, and a stand-in for Triton's compiled launcher runs them as torch
code. On a GPU the public decode-path ops are called repeatedly with new tensors of one signature and
compared with Triton's own launches (``NSA_BACKEND_FAST_LAUNCH=0``, nothing recorded).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from triton import knobs

import nsa_backend as nb
from nsa_backend import _replay, _settings
from nsa_backend.kernels import _launch
from nsa_backend.kernels._arch import device_arch
from nsa_backend.kernels._launch import Launch
from nsa_backend.kernels.indexer import sm90_gluon_paged as gluon_paged

from ._inputs import FP8, decode_args, paged_logits_args


def _at(pointer: Any, n: int) -> torch.Tensor | None:
    """The ``n`` float32 values a stand-in kernel reads at ``pointer`` (a tensor or an address, as
    Triton's launcher takes them)."""
    if pointer is None:
        return None
    address = pointer if isinstance(pointer, int) else pointer.data_ptr()
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


class _Scale:
    """Stands in for a compiled kernel: ``out[:n] = x[:n] * factor + (bias[:n] or 0)`` over flat memory."""

    function = packed_metadata = None

    def run(self, *launch: Any) -> None:
        x, bias, out, n, factor, _block = launch[9:]
        with _disable_current_modes():  # a kernel's work is no tensor operation of the call
            b = _at(bias, n)
            _at(out, n).copy_(_at(x, n) * factor + (b if b is not None else 0))


@pytest.fixture
def stand_in_launches(monkeypatch):
    monkeypatch.delenv("NSA_BACKEND_FAST_LAUNCH", raising=False)
    monkeypatch.setattr(_replay, "run_compiled",
                        lambda compiled, grid, device, args: compiled.run(*grid, None, None, None, None, None, None,
                                                                          *args))


def _stand_in_launch(kernel: _Scale, args: tuple[Any, ...], tail: tuple[Any, ...] = ()) -> None:
    """What ``CachedLauncher`` does for one launch: record it while recording, and run it."""
    recorded = getattr(_launch._recorder, "launches", None)
    if recorded is not None:
        recorded.append(Launch(kernel, (1, 1, 1), args, tail, 0))
        knobs.runtime.launch_enter_hook(None)  # Triton's launch calls the hook
    kernel.run(None, None, None, None, None, None, None, None, None, *args, *tail)


def _launch_scale(x, bias, out, factor, tail=(64,)):
    _stand_in_launch(_Scale(), (x, bias, out, x.numel(), factor), tail)


class _Op:
    """A public op over the stand-in kernel; ``body`` is the implementation, counted per call."""

    def __init__(self, body=None) -> None:
        self.cache = _replay.ReplayCache("stand_in", cuda=False)
        self.calls = 0
        self.body = body or self.scale

    @staticmethod
    def scale(x, bias, factor):
        out = torch.empty(x.shape)
        _launch_scale(x, bias, out, factor)
        return out

    def __call__(self, x, bias=None, factor=2.0, impl="triton"):
        values = (x, bias, factor, impl)
        key = self.cache.key(values)
        if (replay := self.cache.get(key)) is not None:
            return replay(values)
        self.calls += 1
        return self.cache.run(key, values, impl, lambda: self.body(x, bias, factor))


def test_a_second_call_of_a_signature_replays_with_its_own_tensors(stand_in_launches):
    op = _Op()
    for _ in range(3):
        x, bias = torch.randn(4, 8), torch.randn(4, 8)
        torch.testing.assert_close(op(x, bias, 3.0), x * 3.0 + bias)
    assert op.calls == 1 and len(op.cache) == 1
    # a new signature (shape, strides, a None, a scalar's value or type, the impl) records again
    x = torch.randn(4, 8)
    for args in [(torch.randn(2, 8), None, 3.0), (x.view(8, 4), None, 3.0), (x, None, 3.0), (x, None, 5.0),
                 (x, None, 5)]:
        want = args[0] * args[2]
        torch.testing.assert_close(op(*args), want, check_dtype=False)
        torch.testing.assert_close(op(*args), want, check_dtype=False)
    assert op.calls == 6 and len(op.cache) == 6
    op(x, None, 5.0, impl="reference")
    op(x, None, 5.0, impl="reference")
    assert op.calls == 8, "only the triton implementation is recorded"


def test_address_alignment_is_part_of_the_signature(stand_in_launches):
    op = _Op()
    buf = torch.randn(40)
    for offset in (0, 1, 0, 1, 4):
        x = buf[offset:offset + 32]
        torch.testing.assert_close(op(x), x * 2.0)
    # 16-byte aligned, then 4 bytes past; 16 bytes past is aligned again: the first signature, replayed
    # at its own address
    assert op.calls == 2


def test_a_configuration_change_drops_recorded_calls(stand_in_launches):
    op = _Op()
    x = torch.randn(8)
    op(x)
    op(x)
    assert op.calls == 1
    _settings.settings_changed()
    op(x)
    assert op.calls == 2


def test_nothing_is_recorded_with_launches_uncached_or_under_a_tensor_subclass(stand_in_launches, monkeypatch):
    op = _Op()
    x = torch.randn(8)
    monkeypatch.setenv("NSA_BACKEND_FAST_LAUNCH", "0")
    op(x)
    op(x)
    assert op.calls == 2 and len(op.cache) == 0
    monkeypatch.delenv("NSA_BACKEND_FAST_LAUNCH")
    p = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    op(p)
    op(p)
    assert op.calls == 4 and len(op.cache) == 0
    assert _replay.signature((torch.randn(2),)) is None  # a CPU tensor where CUDA is expected


def _copying(x, bias, factor):
    out = torch.empty_like(x)
    _launch_scale(x.clone(), bias, out, factor)  # the kernel reads a copy made per call
    return out


def _offset_view(x, bias, factor):
    out = torch.empty(x.numel() + 4)
    _launch_scale(x, bias, out[4:], factor)  # a kernel writing from inside an allocation on
    return out[4:]  # a view of it: no allocation is returned


def _returns_input(x, bias, factor):
    _launch_scale(x, bias, x, factor)
    return x


def _raw_launch(x, bias, factor):
    out = _Op.scale(x, bias, factor)
    hook = knobs.runtime.launch_enter_hook  # a Triton launch outside CachedLauncher (out += 1) calls it when set
    if hook is not None:  # Triton 3.4 keeps None when no hook is set
        hook(None)
    with _disable_current_modes():
        out.add_(1.0)
    return out


def _filled(x, bias, factor):
    out = torch.empty(2 * x.numel())
    out.fill_(7.0)  # a tensor operation besides the launches
    _launch_scale(x, bias, out[: x.numel()], factor)
    return out


def _descriptor_argument(x, bias, factor):
    out = torch.empty_like(x)
    # an object that holds the first call's address in a way the replay does not know
    _launch_scale(x, bias, out, factor, tail=(object(),))
    return out


@dataclasses.dataclass
class _Descriptor:
    """Stands in for a TMA descriptor: the kernel reads from ``base``'s address on."""

    base: Any
    rows: int


class _Gather(_Scale):
    """``out[:n] = (values at desc.base)[:n] * factor``: the input reached through a descriptor."""

    def run(self, *launch: Any) -> None:
        desc, out, n, factor = launch[9:]
        with _disable_current_modes():
            _at(out, n).copy_(_at(desc.base, n) * factor)


def _through_descriptor(x, bias, factor):
    out = torch.empty(x.numel() - 2)
    desc = _Descriptor(base=x.view(-1)[2:], rows=out.numel())  # its base is 8 bytes into the input
    _stand_in_launch(_Gather(), (desc, out, out.numel(), factor))
    return out


def _interior_pointer(x, bias, factor):
    out = torch.empty(x.numel() - 2)
    _launch_scale(x.view(-1)[2:], None, out, factor)  # the kernel reads from 8 bytes into the input on
    return out


@pytest.mark.parametrize("body", [_copying, _offset_view, _returns_input, _raw_launch, _filled,
                                  _descriptor_argument, _through_descriptor, _interior_pointer])
def test_calls_that_cannot_be_replayed_take_the_ordinary_path_every_time(stand_in_launches, body):
    op = _Op(body)
    for _ in range(3):
        x = torch.randn(8)
        want = x * 2.0
        if body is _raw_launch:
            want = want + 1.0
        elif body is _filled:
            want = torch.cat([want, torch.full((8,), 7.0)])
        elif body in (_through_descriptor, _interior_pointer):
            want = want[2:]
        torch.testing.assert_close(op(x), want)
    assert op.calls == 3 and len(op.cache) == 0


def test_the_signature_keeps_scalar_types_apart():
    x = torch.randn(2)
    keys = {_replay.signature((x, v), cuda=False) for v in (1, 1.0, True, "1", None)}
    assert len(keys) == 5


# ----------------------------------------------------------------------------------------------
# The public ops on a GPU
# ----------------------------------------------------------------------------------------------

def _cuda(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _paged_logits_args(next_n: int, heads: int = 64) -> dict[str, Any]:
    args = _cuda(paged_logits_args(B=3, next_n=next_n, H=heads, D=128, pages=16))
    args["context_lens"] = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda")
    args["block_table"] = torch.randperm(16, device="cuda").to(torch.int32)[:15].view(3, 5)
    args["max_context_len"] = 320
    args["schedule_meta"] = nb.get_paged_mqa_logits_metadata(args["context_lens"], 64, 8, impl="reference")
    return args


def _decode_call(h_q: int, s_q: int, sink: bool, length: bool):
    args = _cuda(decode_args(B=3, s_q=s_q, h_q=h_q, topk=256, num_blocks=6))
    if not length:
        args.pop("topk_length")
    if sink:
        args["attn_sink"] = torch.randn(h_q, device="cuda")
    return args


def _fresh(args: dict[str, Any]) -> dict[str, Any]:
    """New tensors of the same signature: new values in new memory."""
    out = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype != FP8:
            out[k] = torch.randn_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _gpu_cases():
    cases: list[tuple[str, Any, Any, Any]] = []
    for next_n in (1, 2):
        cases.append(("fp8_paged_mqa_logits", lambda n=next_n: _paged_logits_args(n), nb.fp8_paged_mqa_logits,
                      nb.indexer._paged_logits_replays))
    cases.append(("get_paged_mqa_logits_metadata",
                  lambda: {"context_lens": torch.randint(1, 5000, (40,), dtype=torch.int32, device="cuda"),
                           "block_kv": 64, "num_sms": 132},
                  nb.get_paged_mqa_logits_metadata, nb.indexer._metadata_replays))
    for rows, n in ((4, 8192), (64, 32768)):
        cases.append(("topk_indices",
                      lambda r=rows, n=n: {"logits": torch.randn(r, n, device="cuda"), "topk": 2048,
                                           "ends": torch.randint(1, n, (r,), dtype=torch.int32, device="cuda")},
                      nb.topk_indices, nb.topk._topk_replays))
    for h_q, s_q, sink, length in ((16, 1, False, True), (64, 2, True, False), (128, 1, True, True)):
        cases.append(("sparse_mla_decode",
                      lambda h=h_q, s=s_q, a=sink, b=length: _decode_call(h, s, a, b),
                      nb.sparse_mla_decode, nb.sparse_mla._decode_replays))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c[0])
def test_replayed_calls_equal_tritons_own_launches(case, monkeypatch):
    name, make, op, cache = case
    first = make()
    _replays_equal_own_launches(name, first, op, cache, monkeypatch)
    if name == "fp8_paged_mqa_logits" and _gluon_paged_route(first):
        # the sm_90 Gluon kernel takes TMA descriptors, which hold the cache's address: never replayed
        # (a replay would read the first call's cache)
        assert len(cache) == 0
    else:
        assert len(cache) == 1, "the calls were not replayed"


@pytest.fixture
def sm120_route(monkeypatch):
    """Routing forced to sm_120 for a GPU test of its Gluon mma.sync kernels (skipped on a GPU without e4m3 or a
    Triton without Gluon), then back."""
    from nsa_backend.kernels._gluon import gluon_importable
    from nsa_backend.routing.config import reset_config

    if torch.cuda.get_device_capability() < (8, 9) or not gluon_importable():
        pytest.skip("needs a GPU with e4m3 (sm_89+) and Gluon")
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm120")
    reset_config()
    yield
    monkeypatch.delenv("NSA_BACKEND_FORCE_ARCH")
    reset_config()


@pytest.mark.gpu
@pytest.mark.parametrize(("next_n", "heads"), [(1, 64), (2, 32)])
def test_mma_v2_paged_logits_replay(next_n, heads, sm120_route, monkeypatch):
    """Under sm_120's route the paged logits of one row of 64 heads and two rows of 32 take the Gluon mma.sync
    kernel (``sm89_gluon_paged``), whose eager calls replay."""
    from nsa_backend.kernels.indexer import sm89_gluon_paged

    first = _paged_logits_args(next_n, heads)
    kv_cache = first["kv_cache"]
    kv_cache = kv_cache.unsqueeze(2) if kv_cache.dim() == 3 else kv_cache
    assert sm89_gluon_paged.supported(first["q"], kv_cache, device_arch(first["q"].device))
    cache = nb.indexer._paged_logits_replays
    _replays_equal_own_launches("fp8_paged_mqa_logits", first, nb.fp8_paged_mqa_logits, cache, monkeypatch)
    assert len(cache) == 1, "the calls were not replayed"


@pytest.mark.gpu
@pytest.mark.parametrize(("kv_format", "h_q", "s_q", "topk"), [
    ("fp8_ds_mla", 64, 1, 256), ("fp8_ds_mla", 16, 2, 1024), ("bf16", 128, 1, 256), ("bf16", 32, 2, 1024),
])
def test_mma_v2_decode_replay(kv_format, h_q, s_q, topk, sm120_route, monkeypatch):
    """Under sm_120's route the sparse MLA decode takes the Gluon mma.sync kernels (``sm89_gluon`` over the fp8
    cache, ``sm80_gluon`` over the bf16 one), whose eager calls replay: with one split (top-k 256) and with several
    and their merge (top-k 1024)."""
    from nsa_backend.kernels.sparse_mla_decode import _mma_v2_bf16_route, _mma_v2_route

    first = _cuda(decode_args(B=3, s_q=s_q, h_q=h_q, topk=topk, kv_format=kv_format, num_blocks=24))
    route = _mma_v2_route if kv_format == "fp8_ds_mla" else _mma_v2_bf16_route
    assert route(first["q"], first["kv_cache"], kv_format, 512, device_arch(first["q"].device))
    cache = nb.sparse_mla._decode_replays
    _replays_equal_own_launches("sparse_mla_decode", first, nb.sparse_mla_decode, cache, monkeypatch)
    assert len(cache) == 1, "the calls were not replayed"


def _replays_equal_own_launches(name: str, first: dict[str, Any], op: Any, cache: Any, monkeypatch) -> None:
    """Four calls of one signature (the first recorded, three replayed), each equal to Triton's own launches."""
    monkeypatch.delenv("NSA_BACKEND_FAST_LAUNCH", raising=False)
    cache.clear()
    for args in (first, _fresh(first), _fresh(first), _fresh(first)):
        got = op(**args, impl="triton")
        monkeypatch.setenv("NSA_BACKEND_FAST_LAUNCH", "0")
        want = op(**args, impl="triton")
        monkeypatch.delenv("NSA_BACKEND_FAST_LAUNCH")
        if name == "topk_indices":  # the order inside a row is unspecified
            got, want = got.sort(-1).values, want.sort(-1).values
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def _gluon_paged_route(args: dict[str, Any]) -> bool:
    q, kv_cache = args["q"], args["kv_cache"]
    kv_cache = kv_cache.unsqueeze(2) if kv_cache.dim() == 3 else kv_cache
    return gluon_paged.supported(q, kv_cache, device_arch(q.device))
