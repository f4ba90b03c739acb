"""The hot-loop instruction mix (``nsa_backend.kernels.aot_sass``): the SASS parser and loop choice on hand-written
listings, then a real sm_120 compile of the sparse MLA tile (AOT, no GPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nsa_backend.kernels.aot_sass import CLASSES, MixRow, instruction_mix, render
from tests.ops._aot import REPO_ROOT, run_aot_script

# Two loops: .L_x_1 (one HMMA) and .L_x_3 (two QMMA, a spill, a barrier); a forward branch that is no loop.
LISTING = textwrap.dedent("""
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
    .L_x_1:
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   LDS.128 R8, [R1] ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
    .L_x_0:
        /*0050*/                   MOV R0, R1 ;
    .L_x_3:
    .L_x_2:
        /*0060*/                   QMMA.16832.F32.E4M3.E4M3 R12, R16, R4, RZ ;
        /*0070*/                   QMMA.16832.F32.E4M3.E4M3 R12, R20, R6, R12 ;
        /*0080*/                   STL [R1+0x10], R3 ;
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00a0*/                   F2FP.BF16.F32.PACK_AB R3, R4, R5 ;
        /*00b0*/                   FMUL R6, R6, R7 ;
        /*00c0*/              @!UP1 BRA.U `(.L_x_3) ;
        /*00d0*/                   EXIT ;
""")


def test_the_loop_with_most_mma_is_counted():
    mix = instruction_mix(LISTING)
    assert mix.loop
    assert mix.counts == {"mma": 2, "shared_loads": 0, "shared_stores": 0, "barriers": 1, "global_loads": 0,
                          "local": 1, "conversions": 1, "other": 2}
    assert mix.total == 7 and mix.per_mma == 2.5


def test_without_a_loop_the_whole_kernel_is_counted():
    text = "\n".join(line for line in LISTING.splitlines() if "BRA" not in line)
    mix = instruction_mix(text)
    assert not mix.loop
    assert mix.counts["mma"] == 3 and mix.counts["global_loads"] == 1 and mix.total == 11
    assert set(mix.counts) == {*CLASSES, "other"}


def test_no_mma_gives_no_ratio():
    mix = instruction_mix("        /*0000*/                   MOV R0, R1 ;\n")
    assert mix.counts["mma"] == 0 and mix.per_mma is None and not mix.loop


def test_report_lists_kernels_with_mma_and_names_the_rest():
    with_loop = MixRow("fam", "looped", "cfg-a", 120, 4, instruction_mix(LISTING))
    flat = MixRow("fam", "flat", "cfg-b", 86, 8,
                  instruction_mix("\n".join(line for line in LISTING.splitlines() if "BRA" not in line)))
    none = MixRow("other", "copy", "-", 120, 4, instruction_mix("        /*0000*/                   MOV R0, R1 ;\n"))
    text = render([with_loop, flat, none], "cmd")
    assert "| fam/looped | cfg-a | sm_120 | 4 | loop | 2 | 2.5 | 0 | 0 | 1 | 0 | 1 | 1 | 7 |" in text
    assert "| fam/flat | cfg-b | sm_86 | 8 | kernel | 3 | 2.7 | 1 | 0 | 1 | 1 | 1 | 1 | 11 |" in text
    assert text.rstrip().endswith("Without MMA instructions (not listed above): other/copy.")
    assert "`cmd`" in text


_REAL = textwrap.dedent("""
    import dataclasses, json
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble, instruction_mix
    out = {}
    for job in sparse_mla_jobs(120):
        if job.config.startswith(("bf16 BLOCK_H=32", "fp8 BLOCK_H=32")) and job.kind == "decode":
            mix = instruction_mix(disassemble(job.cubin()))
            out[job.config.split()[0]] = dict(mix.counts, loop=mix.loop)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_sparse_mla_decode_loop_on_sm120():
    """The 32-head decode tile: 136 mma.sync per loop pass (72 for ``q K^T``, 64 for ``P V`` per warp), and the
    fp8 cache adds the e4m3 conversions and shared-memory stores of the converted keys to the bf16 loop."""
    got = run_aot_script(_REAL, timeout=600)
    bf16, fp8 = got["bf16"], got["fp8"]
    assert bf16["loop"] and fp8["loop"]
    assert bf16["mma"] == fp8["mma"] == 136
    assert fp8["conversions"] > 100 > bf16["conversions"]
    assert fp8["shared_stores"] > bf16["shared_stores"]


_SHARED_KEYS = textwrap.dedent("""
    import dataclasses, json
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble, instruction_mix
    job = next(j for j in sparse_mla_jobs(120) if j.kind == "decode" and j.constexprs["KV_FP8"]
               and j.constexprs["SHARE_KEYS"])
    plain = dataclasses.replace(job, constexprs={**job.constexprs, "SHARE_KEYS": False})
    out = {}
    for name, j in (("shared", job), ("plain", plain)):
        mix = instruction_mix(disassemble(j.cubin()))
        out[name] = dict(mix.counts, loop=mix.loop, block_h=j.constexprs["BLOCK_H"])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_shared_keys_tile_stores_its_keys_once_on_sm120():
    """The fp8 decode tile that shares its keys (the 16-head tile of the 100 KiB parts) converts each latent group
    once into shared memory for both MMAs: fewer shared loads, barriers and instructions per loop pass than the
    same tile converting per MMA (685 against 902 with Triton 3.9), and no spill in its loop."""
    got = run_aot_script(_SHARED_KEYS, timeout=600)
    shared, plain = got["shared"], got["plain"]
    assert shared["block_h"] == 16 and shared["loop"] and plain["loop"]
    assert shared["mma"] == plain["mma"]
    assert shared["shared_loads"] < plain["shared_loads"] and shared["barriers"] < plain["barriers"], (shared, plain)
    total = {k: sum(v for c, v in d.items() if c not in ("loop", "block_h")) for k, d in got.items()}
    assert total["shared"] <= 0.85 * total["plain"], total
    assert shared["local"] == 0


@pytest.mark.parametrize("module", ["aot_sass", "aot_report"])
@pytest.mark.parametrize("flag,value", [("--family", "nope"), ("--arch", "75")])
def test_bad_flags_exit_2_naming_the_flag(module, flag, value):
    proc = subprocess.run([sys.executable, "-m", f"nsa_backend.kernels.{module}", flag, value, "--out", "/dev/null"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and f"error: {flag}: " in proc.stderr.splitlines()[-1]
