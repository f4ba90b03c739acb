"""The mma.sync proxy: the SM120 / SM8x route timed on a Hopper GPU.

No SM120 or SM8x GPU needs to be at hand to time the kernels those GPUs run. On an sm_90 (or
sm_100) GPU, ``nsa-backend bench --proxy sm120``

- forces routing and the Triton launchers to the proxied arch (``NSA_BACKEND_FORCE_ARCH``): its
  launch configurations and its shared-memory budget (99 KiB per block on sm_120 / sm_121 / sm_86 /
  sm_89, 163 KiB on sm_80), its kernels (the Gluon kernels written for the proxied arch, which
  route by the forced arch as the ``tl`` ones do; no sm_90 Gluon kernel, no native package);
- disables Triton's Hopper MMA (``DISABLE_MMA_V3=1``), so ``tl.dot`` lowers to ``mma.sync``, the
  tensor-core instruction SM120 and SM8x have (no wgmma, no tcgen05);
- gives every SM no more shared memory than an SM of the proxied arch holds (100 KiB on sm_120 / sm_121 /
  sm_86 / sm_89, 164 KiB on sm_80: ``SHARED_MEMORY_PER_SM`` of :mod:`nsa_backend.kernels.aot`) by setting
  each kernel's shared-memory carveout preference as it is loaded (:func:`limit_shared_memory_per_sm`).
  An H100 / H200 SM holds 228 KiB, so without it two programs of an 82 KiB kernel share an SM where
  sm_120 runs one, and the proxy would time a residency the proxied GPU never has (the sm_120 sparse MLA
  decode tile ran 1.5x faster on an H100 that way);
- compiles into a fresh Triton cache, and after the run disassembles every kernel compiled in it
  (:func:`scan_sass`): the proxy holds only when no warpgroup MMA (``HGMMA`` / ``QGMMA``...) is
  left and the kernels' shared memory fits the proxied budget;
- measures the compute ceilings with a plain Triton matmul under the same restriction
  (:mod:`nsa_backend.bench.triton_matmul`) instead of cuBLAS, so ``of_bf16_mm`` / ``of_fp8_mm`` are
  fractions of what mma.sync reaches on this GPU.

What the proxy does not model: the proxied chip's memory bandwidth and clocks (an H200 reads 4.8 TB/s,
an RTX 5090 1.8 TB/s), instruction rates that differ between the chips, and the L1 cache left beside
the shared memory (larger on an H100 / H200 SM). fp8 products in particular: for sm_90 Triton compiles
an e4m3 ``tl.dot`` as fp16 ``mma.sync`` on converted operands (sm_89 / sm_120 take e4m3 ``mma.sync``
at twice their fp16 rate), so the fp8 kernels and the e4m3 limit run at an fp16 rate here
(``docs/performance.md``, "fp8 products under the proxy"). Ratios against the
same-run limits are the comparable figures, not the milliseconds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nsa_backend import envs
from nsa_backend._settings import env_switch
from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT, SHARED_MEMORY_PER_SM
from nsa_backend.routing.config import reset_config

# Arch families the proxy stands in for, with their compute capability.
PROXY_ARCHS: dict[str, int] = {"sm80": 80, "sm86": 86, "sm89": 89, "sm120": 120, "sm121": 121}
# CUDA driver API enum values (cuda.h).
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
# Set while a proxy run is active; benchmark modules then leave the native packages out.
PROXY_ENV = "NSA_BACKEND_BENCH_PROXY"
# Warpgroup (Hopper) and tcgen05 (Blackwell) MMA opcodes: none may remain under the proxy.
WARPGROUP_MMA = re.compile(r"\b([A-Z]GMMA|UTC[A-Z0-9]*MMA[A-Z0-9]*)\b")
# Warp-level MMA opcodes (mma.sync): HMMA (fp16 / bf16 / tf32), QMMA (fp8), IMMA (int8).
WARP_MMA = re.compile(r"\b([HQIDB]MMA)\b")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?", re.M)


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    """What a proxy run set up; recorded in ``results.json`` under ``"proxy"``."""

    arch: str
    capability: int
    shared_memory_limit: int
    triton_cache_dir: str
    shared_memory_per_sm: int = 0
    carveout_percent: int = 0
    disable_mma_v3: bool = True
    # Whether Gluon kernels may run (``NSA_BACKEND_GLUON`` not ``0``): only those written for the proxied arch route.
    gluon: bool = False

    def record(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("triton_cache_dir")
        return out


def active() -> str | None:
    """The proxied arch of the running benchmark (``None`` outside a proxy run)."""
    return os.environ.get(PROXY_ENV) or None


def check_arch(arch: str) -> str:
    """``arch`` if the proxy can stand in for it, else ``ValueError`` naming ``--proxy``."""
    if arch not in PROXY_ARCHS:
        raise ValueError(f"--proxy: expected one of {list(PROXY_ARCHS)} (the mma.sync arches timed on a Hopper "
                         f"GPU), got {arch!r}")
    return arch


def check_gpu(capability: tuple[int, int] | None) -> None:
    """Refuse a GPU the proxy cannot run on: it needs one with warpgroup MMA to take away (sm_90 / sm_100)."""
    if capability is None:
        raise ValueError("--proxy: needs a CUDA GPU (sm_90 or sm_100); without one run the suite without --proxy")
    if capability[0] not in (9, 10):
        raise ValueError(f"--proxy: runs on an sm_90 or sm_100 GPU, this one is sm_{capability[0]}{capability[1]}; "
                         "on an SM120 or SM8x GPU run the suite without --proxy, it then times the real route")


def enable(arch: str, capability: tuple[int, int] | None) -> ProxySettings:
    """Set the process up as the proxy of ``arch``; call before any Triton kernel is compiled.

    Sets ``DISABLE_MMA_V3=1``, ``NSA_BACKEND_FORCE_ARCH=arch``, a fresh
    ``TRITON_CACHE_DIR`` (so :func:`scan_sass` sees this run's kernels only) and :data:`PROXY_ENV`,
    drops routing decisions cached before and limits the shared memory per SM of every kernel loaded
    from now on (:func:`limit_shared_memory_per_sm`).
    """
    check_arch(arch)
    check_gpu(capability)
    cache_dir = tempfile.mkdtemp(prefix=f"nsa-backend-proxy-{arch}-")
    os.environ.update({
        "DISABLE_MMA_V3": "1",
        envs.FORCE_ARCH: arch,
        "TRITON_CACHE_DIR": cache_dir,
        PROXY_ENV: arch,
    })
    _reset_triton_cache_dir(cache_dir)
    reset_config()  # routing re-reads the forced arch
    capability_number = PROXY_ARCHS[arch]
    percent = limit_shared_memory_per_sm(arch)
    return ProxySettings(arch=arch, capability=capability_number,
                         shared_memory_limit=SHARED_MEMORY_LIMIT[capability_number], triton_cache_dir=cache_dir,
                         shared_memory_per_sm=SHARED_MEMORY_PER_SM[capability_number], carveout_percent=percent,
                         gluon=env_switch(envs.GLUON, True))


def carveout_percent(per_sm: int, gpu_per_sm: int) -> int:
    """The carveout preference, in percent of ``gpu_per_sm`` (this GPU's shared memory per SM), that leaves
    an SM ``per_sm`` bytes: the driver rounds a preference up to the next capacity the SM supports, so
    the largest percent at or below ``per_sm`` (100 KiB of an H100's 228: 43 %, rounded up to its 100 KiB
    capacity)."""
    if not 0 < per_sm <= gpu_per_sm:
        raise ValueError(f"per_sm: expected 1..{gpu_per_sm} bytes (this GPU's shared memory per SM), got {per_sm}")
    return max(1, per_sm * 100 // gpu_per_sm)


def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check_cu(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")


def gpu_shared_memory_per_sm(device: int = 0) -> int:
    """Shared memory one SM of CUDA device ``device`` can hold, bytes (the driver's attribute)."""
    cuda = _libcuda()
    _check_cu(cuda.cuInit(0), "cuInit")
    handle, value = ctypes.c_int(), ctypes.c_int()
    _check_cu(cuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    _check_cu(cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                                        handle), "cuDeviceGetAttribute")
    return value.value


def carveout_hook(percent: int, set_attribute: Callable[..., int]) -> Callable[..., None]:
    """A Triton kernel-load hook that sets the shared-memory carveout preference ``percent`` on each loaded
    kernel through ``set_attribute(function, attribute, value)`` (``cuFuncSetAttribute``)."""

    def on_load(module: Any, function: Any, name: str, *_: Any) -> None:
        if function is None:  # the start-of-load call of hook chains that have one
            return
        _check_cu(set_attribute(ctypes.c_void_p(function), CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                ctypes.c_int(percent)), f"cuFuncSetAttribute(carveout {percent} %) of {name}")

    return on_load


def limit_shared_memory_per_sm(arch: str, device: int = 0) -> int:
    """Make every Triton kernel loaded from now on prefer the carveout that leaves each SM of this GPU the
    shared memory of an ``arch`` SM (``SHARED_MEMORY_PER_SM``); returns the percent set.

    A kernel loaded before the call keeps the driver's choice: call this before the first launch.
    """
    from triton import knobs

    percent = carveout_percent(SHARED_MEMORY_PER_SM[PROXY_ARCHS[check_arch(arch)]], gpu_shared_memory_per_sm(device))
    hooks = knobs.runtime.kernel_load_end_hook
    if not hasattr(hooks, "add"):
        raise RuntimeError("--proxy: this Triton has no kernel-load hook chain (knobs.runtime.kernel_load_end_hook); "
                           "the proxy needs it to limit each SM's shared memory")
    hooks.add(carveout_hook(percent, _libcuda().cuFuncSetAttribute))
    return percent


def _reset_triton_cache_dir(cache_dir: str) -> None:
    # Triton reads TRITON_CACHE_DIR through its knobs, which may have cached the value already.
    try:
        from triton import knobs
    except ImportError:
        return
    cache = getattr(knobs, "cache", None)
    if cache is not None and hasattr(cache, "dir"):
        try:
            cache.dir = cache_dir
        except (AttributeError, TypeError):
            pass


def _cuobjdump() -> str | None:
    try:
        from triton import knobs

        path = knobs.nvidia.cuobjdump.path
        if path and Path(path).exists():
            return path
    except (ImportError, AttributeError, RuntimeError):
        pass
    return shutil.which("cuobjdump")


def opcode_counts(sass: str) -> Counter[str]:
    """Opcode -> number of instructions in a ``cuobjdump -sass`` listing (predicates and modifiers dropped)."""
    return Counter(m.group(1) for m in _OPCODE.finditer(sass))


def scan_sass(cache_dir: str | os.PathLike[str], shared_memory_limit: int) -> dict[str, Any]:
    """Disassemble every cubin under ``cache_dir`` and check the proxy held.

    Returns ``{"ok", "problem", "kernels": [{"name", "shared", "num_warps", "warp_mma", "warpgroup_mma",
    "opcodes_mma"}], "totals"}``: ``ok`` is true when at least one kernel was found, none has a warpgroup
    MMA instruction and none uses more shared memory than ``shared_memory_limit``.
    """
    tool = _cuobjdump()
    kernels: list[dict[str, Any]] = []
    if tool is None:
        return {"ok": False, "problem": "cuobjdump not found (neither Triton's nor on PATH)", "kernels": [],
                "totals": {}}
    for cubin in sorted(Path(cache_dir).rglob("*.cubin")):
        meta_path = cubin.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        listing = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
        counts = opcode_counts(listing)
        mma = {op: n for op, n in counts.items() if WARP_MMA.fullmatch(op) or WARPGROUP_MMA.fullmatch(op)}
        kernels.append({
            "name": meta.get("name", cubin.stem),
            "shared": int(meta.get("shared", 0) or 0),
            "num_warps": meta.get("num_warps"),
            "warp_mma": sum(n for op, n in mma.items() if WARP_MMA.fullmatch(op)),
            "warpgroup_mma": sum(n for op, n in mma.items() if WARPGROUP_MMA.fullmatch(op)),
            "opcodes_mma": dict(sorted(mma.items())),
        })
    totals = {
        "kernels": len(kernels),
        "with_warp_mma": sum(k["warp_mma"] > 0 for k in kernels),
        "warp_mma": sum(k["warp_mma"] for k in kernels),
        "warpgroup_mma": sum(k["warpgroup_mma"] for k in kernels),
        "max_shared": max((k["shared"] for k in kernels), default=0),
    }
    problems = []
    if not kernels:
        problems.append(f"no compiled kernel found under {cache_dir}")
    if totals["warpgroup_mma"]:
        names = sorted({k["name"] for k in kernels if k["warpgroup_mma"]})
        problems.append(f"warpgroup MMA left in {names}")
    over = sorted({k["name"] for k in kernels if k["shared"] > shared_memory_limit})
    if over:
        problems.append(f"shared memory over {shared_memory_limit} B in {over}")
    return {"ok": not problems, "problem": "; ".join(problems) or None, "kernels": kernels, "totals": totals}


def gluon_text(settings: dict[str, Any]) -> str:
    """How the run treated the Gluon kernels, for the result tables."""
    if settings.get("gluon"):
        return f"Gluon kernels of {settings['arch']} on (no sm_90 Gluon kernel routes)"
    return "Gluon off"


def sass_markdown(settings: dict[str, Any], sass: dict[str, Any]) -> str:
    """``sass.md``: the proxy's settings, the verdict and one line per compiled kernel."""
    t = sass["totals"]
    lines = [
        f"# SASS check of the {settings['arch']} proxy",
        "",
        f"Settings: `DISABLE_MMA_V3=1`, routing forced to `{settings['arch']}`, {gluon_text(settings)}, shared memory "
        f"budget {settings['shared_memory_limit']} B per block" + per_sm_text(settings) + ".",
        "",
        f"Verdict: **{'held' if sass['ok'] else 'broken'}**" + (f" ({sass['problem']})" if sass["problem"] else ""),
        "",
        f"{t.get('kernels', 0)} kernels compiled in the run; {t.get('with_warp_mma', 0)} use mma.sync "
        f"({t.get('warp_mma', 0)} warp MMA instructions), {t.get('warpgroup_mma', 0)} warpgroup MMA instructions "
        f"in all; largest shared memory {t.get('max_shared', 0)} B.",
        "",
        "| kernel | shared B | warps | warp MMA | warpgroup MMA | MMA opcodes |",
        "|---|---|---|---|---|---|",
    ]
    for k in sorted(sass["kernels"], key=lambda k: k["name"]):
        ops = ", ".join(f"{op} {n}" for op, n in k["opcodes_mma"].items()) or "-"
        lines.append(f"| {k['name']} | {k['shared']} | {k['num_warps']} | {k['warp_mma']} | {k['warpgroup_mma']} "
                     f"| {ops} |")
    return "\n".join(lines) + "\n"


def per_sm_text(settings: dict[str, Any]) -> str:
    """``, <n> B per SM (carveout <p> %)`` where the run limited each SM's shared memory, else empty."""
    if not settings.get("carveout_percent"):
        return ""
    return f", {settings['shared_memory_per_sm']} B per SM (carveout {settings['carveout_percent']} %)"
