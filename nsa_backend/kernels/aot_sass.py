"""Instruction mix of the portable kernels' hot loops, ahead of time (no GPU).

On the mma.sync parts (SM80 / 86 / 89 / 120 / 121) a warp issues its MMAs and every other instruction
from one scheduler, so how many instructions a kernel's main loop spends around each MMA bounds the
share of the matmul rate it can reach. This compiles every :class:`nsa_backend.kernels.aot_registry.AotJob`
of the chosen families for an arch, disassembles the cubin with the ``nvdisasm`` bundled with Triton,
takes the loop that holds the most MMA instructions (the body of a backward branch) and counts its
instructions by class::

    python -m nsa_backend.kernels.aot_sass --arch 120 --arch 86 --out bench/results/aot/sass-mix.md

Classes (SASS opcodes): ``mma`` (``HMMA`` bf16 / fp16 / tf32, ``QMMA`` fp8, ``IMMA``), shared-memory
loads (``LDS``, ``LDSM``), shared-memory stores (``STS``), barriers (``BAR``), global loads (``LDG``,
``LDGSTS``), local memory (``LDL``, ``STL``: register spills), conversions (``F2F``, ``F2FP``, ``I2F``,
``F2I``), and idle slots: any instruction under the never-true predicate ``!PT`` / ``!UPT``, which ptxas
inserts as padding (e.g. between dependent MMAs); it takes an issue slot and does nothing. Counts are static:
one pass of the loop body as compiled, not a profile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import triton

from nsa_backend.kernels.aot_registry import AotJob, map_jobs
from nsa_backend.kernels.aot_report import parse_args

# Opcode (before the first dot) -> class; opcodes not listed count as "other".
OPCODE_CLASS: dict[str, str] = {
    "HMMA": "mma", "QMMA": "mma", "IMMA": "mma",
    "LDS": "shared_loads", "LDSM": "shared_loads",
    "STS": "shared_stores",
    "BAR": "barriers",
    "LDG": "global_loads", "LDGSTS": "global_loads",
    "LDL": "local", "STL": "local",
    "F2F": "conversions", "F2FP": "conversions", "I2F": "conversions", "F2I": "conversions",
}
CLASSES: tuple[str, ...] = ("mma", "shared_loads", "shared_stores", "barriers", "global_loads", "local",
                            "conversions", "idle")
# predicates that never hold: an instruction under one is padding
_NEVER = ("@!PT", "@!UPT")

# "/*0f20*/   @!P1 BRA `(.L_x_2) ;" -> address, predicate, opcode, operands (with the branch label)
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P[T0-9]+)\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class InstructionMix:
    """Instructions of one loop body by class (``counts``: every class of :data:`CLASSES` plus
    ``"other"``); ``loop`` is False when the kernel has no loop holding an MMA (then the whole kernel
    is counted)."""

    counts: dict[str, int]
    loop: bool

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def per_mma(self) -> float | None:
        """Instructions other than MMAs per MMA instruction (``None`` without MMAs)."""
        mma = self.counts.get("mma", 0)
        return (self.total - mma) / mma if mma else None


def nvdisasm_path() -> str:
    """The ``nvdisasm`` bundled with Triton's NVIDIA backend."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.isfile(path):
        raise RuntimeError(f"nvdisasm: expected the copy bundled with Triton at {path}; this Triton has none")
    return path


def disassemble(cubin: bytes) -> str:
    """SASS text of ``cubin`` (``nvdisasm -c``: code sections, with branch labels)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        proc = subprocess.run([nvdisasm_path(), "-c", path], capture_output=True, text=True, check=False)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr[-2000:]}")
    return proc.stdout


def instruction_mix(sass: str) -> InstructionMix:
    """Count the instructions of the loop of ``sass`` that holds the most MMAs.

    A loop is the range from a label to a later branch back to it. Without such a loop (or without
    MMAs in any), the whole text is counted and ``loop`` is False.
    """
    instructions: list[tuple[int, str, str | None]] = []  # (address, class, branch label)
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        predicate, op = m.group(2), m.group(3)
        target = _BRANCH_TARGET.search(m.group(4)) if op == "BRA" else None
        cls = "idle" if predicate in _NEVER else OPCODE_CLASS.get(op, "other")
        instructions.append((addr, cls, target.group(1) if target else None))

    def classify(classes: Sequence[str]) -> dict[str, int]:
        counts = Counter(classes)
        return {name: counts.get(name, 0) for name in (*CLASSES, "other")}

    best: dict[str, int] | None = None
    for addr, _cls, target in instructions:
        start = labels.get(target) if target else None
        if start is None or start > addr:
            continue
        counts = classify([c for a, c, _ in instructions if start <= a <= addr])
        if counts["mma"] and (best is None or counts["mma"] > best["mma"]):
            best = counts
    if best is None:
        return InstructionMix(classify([c for _, c, _ in instructions]), loop=False)
    return InstructionMix(best, loop=True)


@dataclass(frozen=True)
class MixRow:
    """One kernel x configuration x arch and its hot loop's instruction mix."""

    family: str
    kind: str
    config: str
    arch: int
    num_warps: int
    mix: InstructionMix


def _mix(job: AotJob) -> MixRow:
    return MixRow(job.family, job.kind, job.config, job.arch, job.num_warps, instruction_mix(disassemble(job.cubin())))


def collect(archs: Sequence[int], families: Sequence[str] | None = None, workers: int | None = None) -> list[MixRow]:
    """Compile and disassemble every shipped job of ``families`` (default: all) for ``archs``, in
    ``workers`` processes (default: the CPU count)."""
    return map_jobs(_mix, archs, families, workers)


def render(rows: Sequence[MixRow], command: str) -> str:
    """The markdown report: one line per kernel with MMA instructions, then the names of the others."""
    out = [
        "# Instruction mix of the kernels' hot loops",
        "",
        f"Generated by `{command}` with Triton {triton.__version__}, ahead of time (no GPU): static SASS",
        "counts of one pass of the loop that holds the most MMA instructions (`nsa_backend/kernels/aot_sass.py`);",
        "`scope` is `kernel` where no loop holds the MMAs (one tile per program), and the whole kernel is counted.",
        "`other / mma` is the instructions a warp issues around each MMA: on the mma.sync parts one scheduler",
        "issues both, so the larger it is, the smaller the share of the matmul rate the loop can reach. `idle`: the",
        "padding ptxas puts under a never-true predicate (`@!PT` / `@!UPT`), e.g. between dependent MMAs.",
        "",
        "| kernel | config | arch | warps | scope | mma | other / mma | shared loads | shared stores | barriers | "
        "global loads | local (spills) | conversions | idle | all |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.mix.counts
        if not c["mma"]:
            continue
        out.append(f"| {r.family}/{r.kind} | {r.config} | sm_{r.arch} | {r.num_warps} | "
                   f"{'loop' if r.mix.loop else 'kernel'} | {c['mma']} | {r.mix.per_mma:.1f} | {c['shared_loads']} | "
                   f"{c['shared_stores']} | {c['barriers']} | {c['global_loads']} | {c['local']} | "
                   f"{c['conversions']} | {c['idle']} | {r.mix.total} |")
    without = sorted({f"{r.family}/{r.kind}" for r in rows if not r.mix.counts["mma"]})
    if without:
        out += ["", "Without MMA instructions (not listed above): " + ", ".join(without) + "."]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: compile, disassemble, write the table to ``--out``."""
    args, archs = parse_args("python -m nsa_backend.kernels.aot_sass", (__doc__ or "").split("\n")[0],
                             "bench/results/aot/sass-mix.md", (120,), argv)
    start = time.perf_counter()
    try:
        rows = collect(archs, args.family, args.workers)
    except (ValueError, RuntimeError) as exc:
        print(f"nsa_backend.kernels.aot_sass: {exc}", file=sys.stderr)
        return 2
    command = "python -m nsa_backend.kernels.aot_sass " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(render(rows, command.strip()))
    print(f"{len(rows)} kernels in {time.perf_counter() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
