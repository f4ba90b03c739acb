"""``mask_invalid_slots`` (Triton) against ``mask_invalid_slots_reference`` (PyTorch), and its compile check."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.ops._aot import assert_rows_fit, run_aot_script

pytest.importorskip("triton")
ks = pytest.importorskip("nsa_backend.kernels.slots")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _indices(B: int, s_q: int, topk: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # -3 .. num_slots + 5: negative slots, -1 and slots past the cache mixed with valid ones
    return torch.randint(-3, num_slots + 6, (B, s_q, topk), generator=g, dtype=torch.int32)


@pytest.mark.parametrize(
    "B, s_q, topk, width, with_len",
    [(2, 1, 48, 64, True), (3, 2, 64, 64, False), (1, 4, 7, 128, True), (2, 3, 130, 192, False), (2, 1, 0, 64, True)],
)
def test_mask_invalid_slots_matches_reference(B, s_q, topk, width, with_len):
    num_slots = 100
    idx = _indices(B, s_q, topk, num_slots, seed=B * 100 + topk).to(DEVICE)
    length = torch.tensor([topk, topk // 2, 0, topk + 9][:B], dtype=torch.int32, device=DEVICE) if with_len else None
    got = ks.mask_invalid_slots(idx, num_slots, length, width)
    want = ks.mask_invalid_slots_reference(idx, num_slots, length, width)
    assert got.shape == (B, s_q, width) and got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(got, want)
    valid = got[got >= 0]
    assert (valid < num_slots).all()
    assert (got[..., topk:] == -1).all()


def test_mask_invalid_slots_strided_rows():
    idx = _indices(2, 2, 80, 50, seed=1).to(DEVICE)[..., ::2]  # non-unit column stride
    got = ks.mask_invalid_slots(idx, 50, None, 64)
    assert torch.equal(got, ks.mask_invalid_slots_reference(idx, 50, None, 64))


def test_mask_invalid_slots_rejects_bad_input():
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices"):
        ks.mask_invalid_slots(idx.long(), 10)
    with pytest.raises(ValueError, match="width"):
        ks.mask_invalid_slots(idx, 10, None, 4)
    with pytest.raises(TypeError, match="topk_length"):
        ks.mask_invalid_slots(idx, 10, torch.zeros(3, dtype=torch.int32))


_AOT_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    from nsa_backend.kernels import aot
    from nsa_backend.kernels.aot_registry import shipped_jobs

    rows = []
    for job in shipped_jobs(aot.TARGET_ARCHS, ["slots"]):
        k = job.compile()
        rows.append([job.kind, job.arch, job.config, k.shared_bytes, k.shared_limit])
    print("AOT-ROWS " + json.dumps(rows))
""")


def test_mask_invalid_slots_aot_compile_every_arch():
    rows = run_aot_script(_AOT_SCRIPT, timeout=300, marker="AOT-ROWS ")
    assert_rows_fit(rows, {80, 86, 89, 90, 100, 120, 121})
