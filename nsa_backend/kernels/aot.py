"""Ahead-of-time compilation of our Triton kernels for GPUs that are not present.

Used by the tests (and ``nsa-backend doctor``) to prove that every kernel and every launch
configuration compiles for each target architecture, fits its shared-memory budget and does not
spill registers, without a GPU: ``triton.compile`` lowers to PTX and runs ``ptxas`` for the
requested ``sm_XY``.

Registers and spills: Triton's ``n_regs`` / ``n_spills`` metadata is filled in only when the cubin
is loaded on a GPU, so it is not available here. Instead :func:`compile_for_arch` reads what
``ptxas -v`` printed for the compile Triton itself ran (Triton always passes ``-v`` and prints the
log under its ``dump_ptxas_log`` knob; the compile is forced past Triton's cache so that ``ptxas``
runs). These are the figures of the exact cubin a launch would load: same ``ptxas``, same flags.
With a Triton that has no such knob, the bundled ``ptxas`` is run a second time on the PTX
(:func:`ptxas_resources`), with Triton's fused-multiply-add setting but not its other ``ptxas``
flags (e.g. Triton 3.9's ``--regAllocOptLevel=2``), so spill bytes may differ by a few percent.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Architectures we ship kernels for, as compute capabilities (major * 10 + minor).
TARGET_ARCHS: tuple[int, ...] = (80, 86, 89, 90, 100, 120, 121)

# Dynamic shared memory a block may use, in bytes (the opt-in maximum per block).
SHARED_MEMORY_LIMIT: dict[int, int] = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
    121: 99 * 1024,
}

# Shared memory one SM holds (its largest carveout), in bytes: with the registers it decides how many
# programs of a kernel run side by side. Every block also reserves SHARED_MEMORY_PER_BLOCK_RESERVED.
SHARED_MEMORY_PER_SM: dict[int, int] = {
    80: 164 * 1024,
    86: 100 * 1024,
    87: 164 * 1024,
    89: 100 * 1024,
    90: 228 * 1024,
    100: 228 * 1024,
    103: 228 * 1024,
    120: 100 * 1024,
    121: 100 * 1024,
}
SHARED_MEMORY_PER_BLOCK_RESERVED = 1024

# Architectures with e4m3 support in Triton (fp8e4nv); older ones read fp8 bytes as uint8.
FP8_NATIVE_MIN_ARCH = 89

_USED_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class PtxasResources:
    """Per-thread resources ``ptxas -v`` reports for one kernel.

    Attributes
    ----------
    registers : int
        Registers per thread.
    stack_frame : int
        Bytes of local-memory stack frame per thread (spills and local arrays).
    spill_stores, spill_loads : int
        Bytes of register spill stores / loads per thread in the compiled code.
    """

    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int


def parse_ptxas_log(log: str, entry: str) -> PtxasResources:
    """Read the resources of the entry function ``entry`` from a ``ptxas -v`` log.

    Parameters
    ----------
    log : str
        What ``ptxas -v`` printed (its ``info`` lines).
    entry : str
        Name of the kernel (the PTX ``.entry``).

    Raises
    ------
    ValueError
        If the log has no resource lines for ``entry``.
    """
    marker = f"Compiling entry function '{entry}'"
    start = log.find(marker)
    if start < 0:
        raise ValueError(f"ptxas log has no entry function {entry!r}:\n{log[-2000:]}")
    section = log[start + len(marker):]
    following = section.find("Compiling entry function")
    if following >= 0:
        section = section[:following]
    regs, spills = _USED_REGS.search(section), _SPILLS.search(section)
    if regs is None or spills is None:
        raise ValueError(f"ptxas log lists no registers / spills for {entry!r}:\n{section[:2000]}")
    frame, stores, loads = (int(g) for g in spills.groups())
    return PtxasResources(registers=int(regs.group(1)), stack_frame=frame, spill_stores=stores, spill_loads=loads)


def ptxas_resources(ptx: str, entry: str, arch: int, fp_fusion: bool = True) -> PtxasResources:
    """Run Triton's bundled ``ptxas -v`` on ``ptx`` for ``sm_<arch>`` and report ``entry``'s resources.

    Parameters
    ----------
    ptx : str
        PTX of the kernel (``compiled.asm["ptx"]``).
    entry : str
        Name of the kernel.
    arch : int
        Compute capability, e.g. ``120``.
    fp_fusion : bool
        Whether multiplies and adds may fuse (Triton's ``enable_fp_fusion``), as in the real compile.
    """
    from triton.backends.nvidia import compiler as nv

    if hasattr(nv, "get_ptxas"):  # Triton >= 3.5 picks a ptxas per arch
        ptxas = nv.get_ptxas(arch).path
    else:
        ptxas = nv._path_to_binary("ptxas")[0]
    gpu = nv.sm_arch_from_capability(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", *([] if fp_fusion else ["--fmad=false"]), f"--gpu-name={gpu}", src,
               "-o", os.path.join(tmp, "kernel.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed for {entry} on {gpu}: {proc.stderr[-2000:]}")
    return parse_ptxas_log(proc.stderr + proc.stdout, entry)


@dataclass(frozen=True)
class CompiledKernel:
    """What the compiler reports for one kernel, one configuration, one architecture.

    Attributes
    ----------
    name : str
        Kernel name.
    arch : int
        Compute capability compiled for.
    shared_bytes : int
        Shared memory per block (static and dynamic), in bytes.
    num_warps, num_stages : int
        Launch options compiled with.
    registers : int
        Registers per thread (``ptxas``).
    spill_stores, spill_loads : int
        Bytes of register spill stores / loads per thread (``ptxas``); 0 when nothing spills.
    stack_frame : int
        Bytes of local-memory stack frame per thread (``ptxas``).
    """

    name: str
    arch: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0

    @property
    def shared_limit(self) -> int:
        """Shared-memory budget per block of :attr:`arch`, in bytes."""
        return SHARED_MEMORY_LIMIT[self.arch]

    @property
    def fits(self) -> bool:
        """Whether the kernel fits the shared-memory budget of its arch."""
        return self.shared_bytes <= SHARED_MEMORY_LIMIT[self.arch]

    @property
    def spills(self) -> bool:
        """Whether ``ptxas`` spilled registers to local memory."""
        return self.spill_stores > 0 or self.spill_loads > 0


def _compile_logged(src: Any, target: Any, options: dict[str, Any]) -> tuple[Any, str]:
    """``triton.compile`` with ``ptxas`` forced to run and its ``-v`` log captured (empty if this
    Triton cannot print it)."""
    import triton
    from triton import knobs

    nvidia = getattr(knobs, "nvidia", None)
    if nvidia is None or not hasattr(nvidia, "dump_ptxas_log"):
        return triton.compile(src, target=target, options=options), ""
    out = io.StringIO()
    with nvidia.scope(), knobs.compilation.scope():
        nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True  # a cached cubin would skip ptxas and its log
        with contextlib.redirect_stdout(out):
            compiled = triton.compile(src, target=target, options=options)
    return compiled, out.getvalue()


def _is_gluon(fn: Any) -> bool:
    """Whether ``fn`` is a ``@gluon.jit`` kernel (Triton's Gluon dialect)."""
    return type(fn).__name__ == "GluonJITFunction"


def compile_source(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: Sequence[str] = (),
    options: Mapping[str, Any] | None = None,
) -> tuple[Any, str, Any]:
    """``(compiled, ptxas log, JIT function)``: Triton's compiled kernel for ``sm_<arch>`` (its ``asm``
    holds the PTX and the cubin) with the ``ptxas -v`` log of that compile. Arguments as
    :func:`compile_for_arch`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("compile_for_arch needs TRITON_INTERPRET unset (kernels are interpreted otherwise)")
    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap @triton.autotune / @triton.heuristics
        fn = fn.fn
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource
    if _is_gluon(fn):  # a Gluon kernel sets its layouts itself: its own source type lowers it
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **(options or {})}
    compiled, log = _compile_logged(src, GPUTarget("cuda", arch, 32), opts)
    return compiled, log, fn


def compile_for_arch(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: Sequence[str] = (),
    options: Mapping[str, Any] | None = None,
) -> CompiledKernel:
    """Compile a ``@triton.jit`` kernel for ``sm_<arch>`` and report its resource use.

    Parameters
    ----------
    kernel : triton.runtime.JITFunction
        The kernel (not under ``TRITON_INTERPRET=1``, which replaces kernels by interpreters).
    signature : dict
        Triton type of every parameter, e.g. ``{"q_ptr": "*fp8e4nv", "n": "i32", "BLOCK": "constexpr"}``.
    constexprs : dict
        Values of the ``constexpr`` parameters.
    arch : int
        Compute capability, e.g. ``120`` for ``sm_120``.
    num_warps, num_stages : int
        Launch options, as the launcher passes them.
    aligned : sequence of str
        Parameters the runtime would specialise as divisible by 16 (pointers from the caching
        allocator, strides and sizes that are multiples of 16). Without these hints Triton pipelines
        no load, and the reported shared memory is far below what the JIT-compiled kernel uses.
    options : mapping, optional
        Further compile options the launcher passes, e.g. ``{"maxnreg": 128}`` or
        ``{"enable_fp_fusion": False}``.

    Returns
    -------
    CompiledKernel
        Shared memory, registers per thread and spills of the compiled kernel.
    """
    compiled, log, fn = compile_source(kernel, signature, constexprs, arch, num_warps, num_stages, aligned, options)
    entry = compiled.metadata.name
    if f"Compiling entry function '{entry}'" in log:
        res = parse_ptxas_log(log, entry)
    else:
        res = ptxas_resources(compiled.asm["ptx"], entry, arch,
                              bool(getattr(compiled.metadata, "enable_fp_fusion", True)))
    return CompiledKernel(name=fn.__name__, arch=arch, shared_bytes=int(compiled.metadata.shared),
                          num_warps=num_warps, num_stages=num_stages, registers=res.registers,
                          spill_stores=res.spill_stores, spill_loads=res.spill_loads,
                          stack_frame=res.stack_frame)
