"""Which kernel the sparse MLA launchers take per arch, head count and cache format (``prefill_kernel``,
``decode_kernel``): the route table of the Gluon kernels, checked on CPU with stand-ins of the call's tensors. The
launchers dispatch on these answers, and ``nsa-backend plan`` / ``doctor`` print them."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.kernels._gluon import gluon_importable
from nsa_backend.kernels.sparse_mla_decode import DECODE_KERNELS, decode_kernel
from nsa_backend.kernels.sparse_mla_prefill import PREFILL_KERNELS, prefill_kernel

pytestmark = pytest.mark.skipif(not gluon_importable(), reason="needs a Triton with Gluon")

ARCHS = (80, 86, 89, 90, 100, 103, 120, 121)
HEADS = (1, 16, 17, 32, 64, 100, 128)


@pytest.fixture(autouse=True)
def gluon_allowed(monkeypatch):
    """Gluon kernels may be chosen: no interpreter (the choice itself launches nothing), no NSA_BACKEND_GLUON."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)


def decode_stand_ins(h_q: int, kv_format: str, s_q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.zeros(2, s_q, h_q, 576, dtype=torch.bfloat16)
    if kv_format == "fp8_ds_mla":
        return q, torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
    return q, torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)


def expected_decode(arch: int, h_q: int, kv_format: str) -> str:
    if kv_format == "fp8_ds_mla":
        if arch == 90:
            return "sm90_gluon" if h_q <= 16 else "sm90_gluon_ws"
        return "sm89_gluon" if arch in (80, 86, 89, 120, 121) else "portable"
    return "sm80_gluon" if arch in (80, 86, 89, 120, 121) else "portable"


def expected_prefill(arch: int, h_q: int, d_qk: int) -> str:
    if d_qk != 576:
        return "portable"
    if arch == 90:
        return "sm90_gluon_fewhead" if h_q <= 32 else "sm90_gluon"
    return "sm80_gluon" if arch in (80, 86, 89, 120, 121) else "portable"


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernel_per_arch_and_heads(arch, kv_format):
    for h_q in HEADS:
        for s_q in (1, 2):
            q, cache = decode_stand_ins(h_q, kv_format, s_q)
            assert decode_kernel(q, cache, kv_format, 512, arch) == expected_decode(arch, h_q, kv_format), (h_q, s_q)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_kernel_per_arch_and_heads(arch, d_qk):
    for h_q in HEADS:
        q = torch.zeros(8, h_q, d_qk, dtype=torch.bfloat16)
        kv = torch.zeros(64, 1, d_qk, dtype=torch.bfloat16)
        assert prefill_kernel(q, kv, 512, arch) == expected_prefill(arch, h_q, d_qk), h_q


def test_the_portable_kernels_off_cuda_or_with_gluon_off(monkeypatch):
    q, cache = decode_stand_ins(64, "fp8_ds_mla")
    assert decode_kernel(q, cache, "fp8_ds_mla", 512, None) == "portable"
    assert prefill_kernel(q[0], cache.new_zeros(64, 1, 576, dtype=torch.bfloat16), 512, None) == "portable"
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    for arch in ARCHS:
        assert decode_kernel(q, cache, "fp8_ds_mla", 512, arch) == "portable"
        assert prefill_kernel(q[0], cache.new_zeros(64, 1, 576, dtype=torch.bfloat16), 512, arch) == "portable"


def test_what_the_gluon_kernels_cannot_take_goes_to_the_portable_tile():
    # a cache whose pages are 8 bytes apart: the copies move 16-byte vectors
    q, _ = decode_stand_ins(64, "bf16")
    spaced = torch.zeros(4, 64 * 576 + 4, dtype=torch.bfloat16)[:, : 64 * 576].view(4, 64, 1, 576)
    assert decode_kernel(q, spaced, "bf16", 512, 120) == "portable"
    # more query rows than the fp8 mma.sync decode's grid takes
    _, cache = decode_stand_ins(16, "fp8_ds_mla")
    q_rows = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16).expand(70000, 1, 16, 576)
    assert decode_kernel(q_rows, cache, "fp8_ds_mla", 512, 120) == "portable"
    # an fp16 q
    q16 = torch.zeros(8, 64, 576, dtype=torch.float16)
    assert prefill_kernel(q16, torch.zeros(64, 1, 576, dtype=torch.float16), 512, 120) == "portable"


def test_every_answer_has_words():
    assert set(DECODE_KERNELS) == {"sm90_gluon", "sm90_gluon_ws", "sm89_gluon", "sm80_gluon", "portable"}
    assert set(PREFILL_KERNELS) == {"sm90_gluon_fewhead", "sm90_gluon", "sm80_gluon", "portable"}
