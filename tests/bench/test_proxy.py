"""The mma.sync proxy (``nsa-backend bench --proxy``): its refusals, and its SASS check.

The SASS check is exercised on CPU: the proxy's Triton matmul is compiled ahead of time for sm_90
with and without ``DISABLE_MMA_V3`` into a scratch Triton cache, and :func:`scan_sass` must accept
the first (mma.sync only) and reject the second (warpgroup MMA left).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nsa_backend.bench import proxy
from nsa_backend.bench.runner import run_suite
from tests.ops._aot import REPO_ROOT, run_aot_script

# Compiles the proxy matmul for sm_90 into the cache dir given as argv[1], then prints scan_sass's verdict.
_COMPILE_AND_SCAN = r"""
import json, os, sys
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nsa_backend.bench import proxy, triton_matmul
sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
       "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
       "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "STAGES": "constexpr"}
consts = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "STAGES": 3}
names = list(sig)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "b_ptr", "c_ptr", "K", "stride_am",
                                                                "stride_bn", "stride_cm")}
src = ASTSource(fn=triton_matmul._matmul_kernel, signature=sig, constexprs=consts, attrs=attrs)
triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
result = proxy.scan_sass(sys.argv[1], 99 * 1024)
print(json.dumps({k: result[k] for k in ("ok", "problem", "totals")}))
"""


def _compile_and_scan(tmp_path, disable_mma_v3: bool) -> dict:
    env = {"DISABLE_MMA_V3": "1"} if disable_mma_v3 else {"DISABLE_MMA_V3": "0"}
    return run_aot_script(_COMPILE_AND_SCAN, str(tmp_path), timeout=600, env=env)


def test_sass_check_holds_with_hopper_mma_disabled(tmp_path):
    got = _compile_and_scan(tmp_path / "proxy", disable_mma_v3=True)
    assert got["ok"], got["problem"]
    assert got["totals"]["kernels"] == 1
    assert got["totals"]["warp_mma"] > 0  # tl.dot became mma.sync (HMMA)
    assert got["totals"]["warpgroup_mma"] == 0


def test_sass_check_catches_warpgroup_mma(tmp_path):
    got = _compile_and_scan(tmp_path / "native", disable_mma_v3=False)
    assert not got["ok"]
    assert "warpgroup MMA left in ['_matmul_kernel']" in got["problem"]
    assert got["totals"]["warpgroup_mma"] > 0


def test_sass_check_flags_shared_memory_over_budget(tmp_path):
    # A cubin's metadata beyond the budget: the verdict names the kernel (no MMA needed for this).
    kdir = tmp_path / "abc"
    kdir.mkdir()
    (kdir / "big.json").write_text(json.dumps({"name": "big_kernel", "shared": 200 * 1024, "num_warps": 4}))
    (kdir / "big.cubin").write_bytes(b"not a cubin")
    got = proxy.scan_sass(tmp_path, 99 * 1024)
    assert not got["ok"]
    assert "shared memory over 101376 B in ['big_kernel']" in got["problem"]


def test_sass_check_needs_kernels(tmp_path):
    got = proxy.scan_sass(tmp_path, 99 * 1024)
    assert not got["ok"] and "no compiled kernel" in got["problem"]


def test_opcode_counts_reads_predicated_and_modified_instructions():
    listing = """
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0110*/              @P0  HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0130*/             @!PT  LDS.128 R0, [R2] ;
    """
    counts = proxy.opcode_counts(listing)
    assert counts["HMMA"] == 2 and counts["HGMMA"] == 1 and counts["LDS"] == 1


@pytest.mark.parametrize("arch", ["sm90", "sm100", "rocm", "SM120", ""])
def test_unknown_proxy_arch_is_refused(arch):
    with pytest.raises(ValueError, match=r"--proxy: expected one of \['sm80', 'sm86', 'sm89', 'sm120', 'sm121'\]"):
        proxy.check_arch(arch)


@pytest.mark.parametrize(("capability", "message"), [
    (None, "--proxy: needs a CUDA GPU"),
    ((12, 0), "this one is sm_120; .*without --proxy"),
    ((8, 9), "this one is sm_89"),
])
def test_gpu_that_cannot_be_the_proxy_is_refused(capability, message):
    with pytest.raises(ValueError, match=message):
        proxy.check_gpu(capability)


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")


@no_gpu
def test_run_suite_refuses_the_proxy_before_running_anything(tmp_path):
    if proxy.active():
        pytest.skip("a proxy run is active in this process")
    with pytest.raises(ValueError, match="--proxy: needs a CUDA GPU"):
        run_suite(["topk"], quick=True, out=tmp_path, plots=False, progress=False, proxy_arch="sm120")
    assert not list(tmp_path.iterdir())  # no results written


@no_gpu
def test_cli_proxy_without_gpu_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nsa_backend.bench", "--proxy", "sm120", "--quick", "--out",
                           str(tmp_path), "--no-plots", "--no-progress"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--proxy: needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_rejects_unknown_proxy_arch():
    proc = subprocess.run([sys.executable, "-m", "nsa_backend.bench", "--proxy", "sm90"], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2
    assert "--proxy: invalid choice: 'sm90'" in proc.stderr
