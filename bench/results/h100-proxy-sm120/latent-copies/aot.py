"""The fp8 mma.sync decode's builds (``sparse_mla_decode/sm89_gluon.py``, as the registry lists them) compiled for
each arch named on the command line (default 120) with the Triton this Python imports: one JSON line per build with
its shared memory, registers, spill, the hot loop's instructions and CTA barriers, and the cp.async copies (LDGSTS),
MMAs and fp32 -> bf16 packs (F2FP) of two stretches of SASS between CTA barriers: the one where the first MMAs are
(a tile's scores) and the one before it (the tile's conversion). No GPU needed.

    PYTHONPATH=<tree> python aot.py 120 86   # the tree's kernel; run.sh aot: each candidate's
"""

import json
import re
import sys

import triton

from nsa_backend.kernels.aot_registry import sparse_mla_jobs
from nsa_backend.kernels.aot_sass import disassemble, instruction_mix

_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def stretches(sass: str) -> list[dict[str, int]]:
    """Per stretch of ``sass`` between two ``BAR.SYNC``: its copies, MMAs and conversions."""
    out = [dict(copies=0, mma=0, conversions=0)]
    for m in _OP.finditer(sass):
        op = m.group(1)
        if op.startswith("BAR.SYNC"):
            out.append(dict(copies=0, mma=0, conversions=0))
        for key, prefix in (("copies", "LDGSTS"), ("mma", "HMMA"), ("conversions", "F2FP")):
            out[-1][key] += op.startswith(prefix)
    return out


def main() -> None:
    for arch in [int(a) for a in sys.argv[1:]] or [120]:
        for job in sparse_mla_jobs(arch):
            if job.kind != "decode_mma_v2":
                continue
            res = job.compile()
            sass = disassemble(job.cubin())
            mix = instruction_mix(sass)
            parts = stretches(sass)
            i = next(k for k, part in enumerate(parts) if part["mma"])
            print(json.dumps(dict(
                triton=triton.__version__, arch=arch, config=job.config, shared=res.shared_bytes,
                registers=res.registers, spill=res.spill_stores, loop_instructions=mix.total,
                loop_barriers=mix.counts["barriers"], loop_mma=mix.counts["mma"],
                conversion_stretch=parts[i - 1], scores_stretch=parts[i])), flush=True)


if __name__ == "__main__":
    main()
