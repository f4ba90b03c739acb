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


@pytest.mark.parametrize(("per_sm", "gpu_per_sm", "percent"), [
    (100 * 1024, 228 * 1024, 43),  # sm_120 on an H100 / H200: rounded up to its 100 KiB capacity
    (164 * 1024, 228 * 1024, 71),  # sm_80
    (228 * 1024, 228 * 1024, 100),
])
def test_carveout_percent_stays_within_the_proxied_sm(per_sm, gpu_per_sm, percent):
    got = proxy.carveout_percent(per_sm, gpu_per_sm)
    assert got == percent
    assert got * gpu_per_sm / 100 <= per_sm


@pytest.mark.parametrize("per_sm", [0, 229 * 1024])
def test_carveout_percent_refuses_what_the_gpu_cannot_give(per_sm):
    with pytest.raises(ValueError, match=r"per_sm: expected 1\.\.233472 bytes"):
        proxy.carveout_percent(per_sm, 228 * 1024)


def test_carveout_hook_sets_the_preference_of_each_loaded_kernel():
    calls = []

    def set_attribute(function, attribute, value):
        calls.append((function.value, attribute, value.value))
        return 0

    hook = proxy.carveout_hook(43, set_attribute)
    hook(None, None, "k", {}, "h")  # a start-of-load call: nothing loaded yet
    hook(object(), 0x1234, "k", {}, "h")
    assert calls == [(0x1234, proxy.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 43)]


def test_carveout_hook_reports_a_driver_error_with_the_kernel():
    hook = proxy.carveout_hook(43, lambda *args: 1)
    with pytest.raises(RuntimeError, match=r"cuFuncSetAttribute\(carveout 43 %\) of my_kernel failed with CUDA "
                                           r"driver error 1"):
        hook(object(), 0x1234, "my_kernel", {}, "h")


def test_settings_text_names_the_shared_memory_per_sm():
    settings = proxy.ProxySettings("sm120", 120, 101376, "/tmp/x", 102400, 43).record()
    assert proxy.per_sm_text(settings) == ", 102400 B per SM (carveout 43 %)"
    assert "102400 B per SM (carveout 43 %)" in proxy.sass_markdown(settings, proxy.scan_sass("/nonexistent", 1))


# Loads the proxy matmul with a 64 KiB tile (argv[1] == "limit": after limiting each SM to sm_120's shared
# memory) and prints the programs one SM can hold, as the driver's occupancy calculator counts them.
_RESIDENT_PROGRAMS = r"""
import ctypes, sys
import torch
from nsa_backend.bench import proxy, triton_matmul
if sys.argv[1] == "limit":
    proxy.limit_shared_memory_per_sm("sm120")
a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
c = torch.empty_like(a)
kernel = triton_matmul._matmul_kernel[(4,)](a, a, c, 256, 256, 256, 256, 256, 256, BLOCK_M=128, BLOCK_N=128,
                                            BLOCK_K=32, GROUP_M=4, STAGES=4, num_warps=4, num_stages=4)
torch.cuda.synchronize()
n = ctypes.c_int()
status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
    ctypes.byref(n), ctypes.c_void_p(kernel.function), 128, kernel.metadata.shared)
assert status == 0, status
print(kernel.metadata.shared, n.value)
"""


@pytest.mark.gpu
def test_proxy_holds_as_many_programs_per_sm_as_the_proxied_arch():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the proxy runs on sm_90 / sm_100 GPUs")
    resident = {}
    for mode in ("free", "limit"):
        proc = subprocess.run([sys.executable, "-c", _RESIDENT_PROGRAMS, mode], capture_output=True, text=True,
                              cwd=REPO_ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        shared, resident[mode] = map(int, proc.stdout.split())
    per_program = shared + 1024  # the driver reserves 1 KiB per block
    assert resident["limit"] == proxy.SHARED_MEMORY_PER_SM[120] // per_program
    assert resident["free"] > resident["limit"]
