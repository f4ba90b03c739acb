"""Triton "fp8_ds_mla" packing (``pack_fp8_ds_mla_triton``, ``write_fp8_ds_mla_cache_triton``) against
``nsa_backend.reference``: byte-for-byte equality for both scale formats, special values (zeros, -0,
all-zero groups, subnormal e4m3 results, exact powers of two, values at the 448 limit), negative and
out-of-range slots, spaced pages. GPU: a seeded fuzz of 300 cases. AOT: the kernel compiles for
sm_80 ... sm_121 (it uses no fp8 type, so one variant serves every architecture).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from nsa_backend import reference as ref
from tests.ops._aot import run_aot_script

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("arbitrary", "pow2")


def _special_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, 576]`` bf16 rows over many magnitudes, with hand-picked edge values in the first rows."""
    mags = torch.logspace(-9, 4, n)[:, None]
    x = torch.randn(n, 576, generator=gen) * mags
    x[0] = 0.0  # all-zero groups -> amax floor
    x[1, :128] = 0.0
    x[1, 128:256] = -0.0
    x[2, :] = 7 * 2.0**-3  # amax / 448 is an exact power of two
    x[3, :128] = torch.linspace(-1, 1, 128)  # includes values that round into e4m3 subnormals
    x[3, 5] = 448.0
    x[4, 256:384] = 1e-3  # tiny group: subnormal outputs
    return x.bfloat16()


@pytest.mark.parametrize("scale_format", FORMATS)
def test_pack_bytes_match_reference(scale_format):
    from nsa_backend.kernels.fp8_ds_mla import pack_fp8_ds_mla_triton

    x = _special_rows(24, torch.Generator().manual_seed(0)).to(DEV)
    got = pack_fp8_ds_mla_triton(x, scale_format)
    want = ref.pack_fp8_ds_mla(x, scale_format)
    assert got.shape == (24, 656) and got.dtype == torch.uint8
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("four_d", [False, True], ids=["3d", "4d"])
def test_write_cache_matches_reference(scale_format, four_d):
    from nsa_backend.kernels.fp8_ds_mla import write_fp8_ds_mla_cache_triton

    g = torch.Generator().manual_seed(1)
    num_blocks, page, T = 3, 8, 12
    x = _special_rows(T, g).to(DEV)
    base = torch.randint(0, 256, (num_blocks, page + 2, 656), generator=g, dtype=torch.uint8).to(DEV)
    cache = base[:, :page]  # pages spaced apart (stride(0) > page * 656)
    if four_d:
        cache = cache.unsqueeze(2)
    slots = torch.randperm(num_blocks * page, generator=g)[:T].to(DEV)
    slots[2] = -1
    slots[5] = num_blocks * page + 3  # out of range: skipped
    want_base = base.clone()
    want = want_base[:, :page].unsqueeze(2) if four_d else want_base[:, :page]
    ref.write_fp8_ds_mla_cache(x, want, slots, scale_format)
    write_fp8_ds_mla_cache_triton(x, cache, slots.int(), scale_format)
    assert torch.equal(base, want_base)


def test_pack_empty():
    from nsa_backend.kernels.fp8_ds_mla import pack_fp8_ds_mla_triton

    out = pack_fp8_ds_mla_triton(torch.zeros(0, 576, dtype=torch.bfloat16, device=DEV), "pow2")
    assert out.shape == (0, 656)


_AOT_SCRIPT = textwrap.dedent("""
    import json
    from nsa_backend.kernels.aot import TARGET_ARCHS
    from nsa_backend.kernels.aot_registry import shipped_jobs
    rows = []
    for job in shipped_jobs(TARGET_ARCHS, ["fp8_ds_mla"]):
        r = job.compile()
        rows.append([job.arch, job.constexprs["POW2"], r.shared_bytes, r.fits])
    print(json.dumps(rows))
""")


def test_aot_pack_kernel_all_archs():
    rows = run_aot_script(_AOT_SCRIPT, timeout=600, env={"TRITON_DEFAULT_FP_FUSION": "1"})
    assert all(r[-1] for r in rows), rows


@pytest.mark.gpu
def test_pack_gpu_fuzz():
    from nsa_backend.kernels.fp8_ds_mla import pack_fp8_ds_mla_triton, write_fp8_ds_mla_cache_triton

    for i in range(300):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(1, 3000, (1,), generator=g))
        fmt = FORMATS[i % 2]
        x = (
            torch.randn(n, 576, generator=g)
            * torch.logspace(-8, 4, n)[torch.randperm(n, generator=g)][:, None]
        )
        x = x.bfloat16().cuda()
        got = pack_fp8_ds_mla_triton(x, fmt)
        # The reference runs on CPU: PyTorch's CUDA division by a Python scalar multiplies by the
        # rounded reciprocal, so on GPU ``amax / 448`` can differ from the exact quotient in the last bit.
        want = ref.pack_fp8_ds_mla(x.cpu(), fmt).cuda()
        assert torch.equal(got, want), f"case {i}: {(got != want).sum().item()} bytes differ"
        if i % 10 == 0:
            page = 64
            blocks = n // page + 2
            cache = torch.zeros(blocks, page, 1, 656, dtype=torch.uint8, device="cuda")
            cache2 = cache.clone()
            slots = torch.randperm(blocks * page, generator=g)[:n].cuda()
            write_fp8_ds_mla_cache_triton(x, cache, slots, fmt)
            cache2 = cache2.cpu()
            ref.write_fp8_ds_mla_cache(x.cpu(), cache2, slots.cpu(), fmt)
            cache2 = cache2.cuda()
            assert torch.equal(cache, cache2), f"case {i}: cache bytes differ"
