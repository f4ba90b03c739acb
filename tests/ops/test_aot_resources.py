"""Registers, spills and shared memory of every portable kernel on the archs without the sm_90 kernels.

AOT (no GPU): every kernel of ``nsa_backend.kernels.aot_registry`` with every launch configuration the
launchers use is compiled for sm_120, sm_121 and sm_86 (the SM8x arch with the smallest shared-memory
budget); none may spill registers and each must fit the arch's shared-memory budget. The full table
for every target arch is ``bench/results/aot/resources.md`` (``python -m nsa_backend.kernels.aot_report``).
Also: the ``ptxas -v`` parser, the captured log against a second ``ptxas`` run, and the check itself
flags a spilling and an oversized configuration.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from nsa_backend.configs.indexer import PAGED_SMALL_TUNED
from nsa_backend.configs.sparse_mla import PROGRAMS_PER_SM, decode_config
from nsa_backend.kernels.aot import (
    SHARED_MEMORY_LIMIT,
    SHARED_MEMORY_PER_BLOCK_RESERVED,
    SHARED_MEMORY_PER_SM,
    parse_ptxas_log,
)
from nsa_backend.kernels.aot_registry import shipped_jobs
from tests.ops._aot import run_aot_script

# sm_120 / sm_121 (the consumer Blackwell targets) and one SM8x; all seven are in the committed table.
ARCHS: tuple[int, ...] = (120, 121, 86)

# (family, kind, arch) that spill today (bench/results/aot/resources.md), with why; their tests are strict
# xfails, so that a fix (or a new spill elsewhere) shows up.
_SPARSE_MLA = ("the 32-head tiles at 4 warps hold four [32, 128] fp32 accumulators (128 registers) in every warp; with "
               "the keys beside them ptxas spills 4-24 bytes on sm_120 / 121 (8 warps spill nothing but ran slower "
               "under the sm_120 proxy)")
_FP8_DECODE = ("the 32-head fp8 decode tile takes 64 keys per pass: 460-556 B of spill on sm_86 / 89 / 120 / 121 "
               "(520 on sm_120, 2096 if it held a converted copy for P V instead of reading its keys again; 272 on "
               "sm_86 with the power-of-two dequantisation), and "
               "1.20-1.34x faster than the 32-key tile under the sm_120 proxy (1.03-1.16x with sm_86's "
               "configuration); over 8 warps it spills nothing but one program fits per SM, and that ran only "
               "1.00-1.07x the 32-key tile")
_MHC = "the 128-wide bf16x2 / bf16x3 GEMM tiles at 4 warps spill a few bytes"
_V4 = ("the 32-head DeepSeek-V4 decode tile over 8 warps spills 12 B on sm_120 (none on sm_86) and ran 1.65x faster "
       "under the sm_120 proxy than the 16-head tile, which spills nothing")
_MMA_V2_TILE = ("the Gluon mma.sync tile holds q's latent part and a [32, 512] accumulator in its eight warps at "
                "255 registers. The bf16 kernel (prefill and bf16 decode) takes two 32-key tiles an iteration, one "
                "per ring stage, so that Triton puts no CTA barrier between one stage's copies and the other's "
                "products; CUDA 13's ptxas (Triton 3.8 / 3.9) then keeps values in local memory on sm_120 / 121: "
                "with the rope's scores in their own accumulator 16 B / 12 B for the prefill / bf16 decode with "
                "Triton 3.9 (seven / five loads per two tiles) and 28 B with 3.8 (thirteen), 20 B (nine) before. "
                "The fp8 decode, whose lazy rescale branches around O's products and which keeps a tile's row "
                "offsets from its latent copies to its rope copy an iteration later, keeps 12 B with Triton 3.9 "
                "and 8 B with 3.8, and its sm_86 / 89 builds 4 B with 3.6. The other sm_80 / 86 / 89 builds and "
                "the sm_120 and sm_90 builds of Triton 3.6 spill nothing, and under the proxy the two-tile loop ran "
                "the prefill 1.07-1.08x and the bf16 decode 1.06-1.07x faster, the lazy rescale the fp8 decode "
                "1.01-1.06x with arbitrary scales, the rope's own accumulator the prefill 1.01-1.02x, the latent "
                "copies issued after the conversion the fp8 decode 0.99-1.10x")

KNOWN_SPILLS: dict[tuple[str, str, int], str] = {
    **{("sparse_mla", "prefill", a): _SPARSE_MLA for a in (120, 121)},
    **{("sparse_mla", "decode", a): _FP8_DECODE for a in (86, 89)},
    **{("sparse_mla", "decode", a): f"{_SPARSE_MLA}; {_FP8_DECODE}" for a in (120, 121)},
    **{("mhc", "gemm", a): _MHC for a in (120, 121, 86)},
    **{("sparse_mla_v4", "decode", a): _V4 for a in (120, 121)},
    **{("sparse_mla", kind, a): _MMA_V2_TILE for kind in ("prefill_mma_v2", "decode_bf16_mma_v2", "decode_mma_v2")
       for a in (120, 121)},
}


def problems(rows: list[dict]) -> list[str]:
    """One line per row that spills registers or exceeds its shared-memory budget, naming kernel, config
    and arch."""
    out = []
    for r in rows:
        limit = SHARED_MEMORY_LIMIT[r["arch"]]
        if r["spill_stores"] or r["spill_loads"]:
            out.append(f"{r['family']}/{r['kind']} [{r['config']}] sm_{r['arch']}: spills {r['spill_stores']} B "
                       f"stores / {r['spill_loads']} B loads per thread ({r['registers']} registers)")
        if r["shared_bytes"] > limit:
            out.append(f"{r['family']}/{r['kind']} [{r['config']}] sm_{r['arch']}: {r['shared_bytes']} B shared "
                       f"> {limit} B budget")
    return out


_COLLECT = textwrap.dedent("""
    import dataclasses, json, os, sys
    from nsa_backend.kernels.aot_report import collect
    rows = collect(json.loads(sys.argv[1]), workers=os.cpu_count())
    print("AOT-ROWS " + json.dumps([dataclasses.asdict(r) for r in rows]))
""")


@pytest.fixture(scope="module")
def aot_rows() -> list[dict]:
    return run_aot_script(_COLLECT, json.dumps(list(ARCHS)), timeout=900, marker="AOT-ROWS ",
                          env={"TRITON_DEFAULT_FP_FUSION": "1"})


def _cases() -> list:
    cases = []
    for arch in ARCHS:
        for family, kind in dict.fromkeys((j.family, j.kind) for j in shipped_jobs([arch])):
            reason = KNOWN_SPILLS.get((family, kind, arch))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cases.append(pytest.param(family, kind, arch, id=f"{family}-{kind}-sm{arch}", marks=marks))
    return cases


@pytest.mark.parametrize("family,kind,arch", _cases())
def test_aot_no_spills_and_fits_shared_memory(aot_rows: list[dict], family: str, kind: str, arch: int):
    mine = [r for r in aot_rows if (r["family"], r["kind"], r["arch"]) == (family, kind, arch)]
    assert mine, f"{family}/{kind} was not compiled for sm_{arch}"
    assert all(r["registers"] > 0 for r in mine), mine
    bad = problems(mine)
    assert not bad, "\n".join(bad)


def test_aot_every_family_compiled(aot_rows: list[dict]):
    expected = {(j.family, j.kind, j.arch, j.config) for j in shipped_jobs(ARCHS)}
    got = {(r["family"], r["kind"], r["arch"], r["config"]) for r in aot_rows}
    assert got == expected, f"missing {sorted(expected - got)[:5]}"


# (padded heads, rows) of the paged entries whose chunks are planned for the programs the sm_120 build holds.
PLANNED_BY_OCCUPANCY = ((64, 1),)


def programs_per_sm(row: dict, num_warps: int) -> int:
    """Programs of a compiled kernel one SM holds at once, by its registers (65536 per SM, allocated per warp
    in units of 256) and its shared memory (each block also reserves ``SHARED_MEMORY_PER_BLOCK_RESERVED``)."""
    per_warp = -(-row["registers"] * 32 // 256) * 256
    by_registers = 65536 // (per_warp * num_warps)
    by_shared = SHARED_MEMORY_PER_SM[row["arch"]] // (row["shared_bytes"] + SHARED_MEMORY_PER_BLOCK_RESERVED)
    return min(by_registers, by_shared)


def test_programs_per_sm_counts_registers_and_shared_memory():
    row = {"arch": 120, "registers": 106, "shared_bytes": 16644}
    assert programs_per_sm(row, 4) == 4  # 112 registers: 4 x 14336 per SM; shared memory would allow 5
    assert programs_per_sm(dict(row, registers=96), 4) == 5
    assert programs_per_sm(dict(row, registers=64, shared_bytes=49152), 4) == 2


def test_fp8_decode_tiles_hold_the_programs_per_sm_their_splits_plan_for(aot_rows: list[dict]):
    # The split of the top-k list fills one wave of PROGRAMS_PER_SM programs per SM: the fp8_ds_mla decode
    # tiles, as compiled, must let that many share one SM's registers and shared memory; the configuration's
    # shared-memory estimate (which picks the tile) is a lower bound of the compiled figure.
    rows = {(r["arch"], r["config"]): r for r in aot_rows if (r["family"], r["kind"]) == ("sparse_mla", "decode")}
    checked = 0
    for job in shipped_jobs(ARCHS, ["sparse_mla"]):
        if job.kind != "decode" or not job.constexprs["KV_FP8"]:
            continue
        row = rows[(job.arch, job.config)]
        per_sm = PROGRAMS_PER_SM[job.constexprs["BLOCK_H"]]
        held = programs_per_sm(row, job.num_warps)
        assert per_sm <= held, (job.arch, job.config, per_sm, held)
        cfg = decode_config(job.constexprs["BLOCK_H"], job.arch, True)
        assert cfg.block_n == job.constexprs["BLOCK_N"]
        assert cfg.shared_bytes_estimate(True) <= row["shared_bytes"], (job.arch, cfg, row["shared_bytes"])
        checked += 1
    # the 16- and 32-head tiles of each arch, and on sm_86 both again with the power-of-two dequantisation
    assert checked == 2 * len(ARCHS) + 2


def test_small_paged_entries_plan_for_the_programs_an_sm_holds(aot_rows: list[dict]):
    # The paged logits cut each request into chunks for one wave of `resident` programs per SM. The 64-head,
    # one-row entry of the 100 KiB-per-SM parts plans for what its tile holds as compiled for sm_120 / 121 (the
    # plan for 6 where registers allowed 4 left a partial last wave). The other entries keep the plan their
    # sweeps timed fastest under the proxy, whose builds hold other counts than sm_120's (fp8 products as fp16
    # MMAs there: bench/results/h100-proxy-sm120/paged-small-table). sm_86 is left out: its fp16 operands double
    # the tile's shared memory (3 programs per SM), and under the proxy its configuration still ran faster with
    # chunks for 4 than for 3 (bench/results/h100-proxy-sm120/decode-64-keys-and-paged-plan).
    checked = 0
    for hp, rows in PLANNED_BY_OCCUPANCY:
        cfg = PAGED_SMALL_TUNED[(hp, rows)]
        for arch in (120, 121):
            mine = [r for r in aot_rows if (r["family"], r["kind"], r["arch"]) == ("indexer", "paged", arch)
                    and r["config"] == f"HP={hp} next_n={rows} D=128 {cfg}"]
            assert len(mine) == 1, (arch, hp, rows)
            assert programs_per_sm(mine[0], cfg.num_warps) == cfg.resident, (arch, mine[0], cfg)
            checked += 1
    assert checked == len(PLANNED_BY_OCCUPANCY) * 2


def test_aot_parse_ptxas_log():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'a' for 'sm_120a'\n"
           "ptxas info    : Function properties for a\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_120a'\n"
           "ptxas info    : Function properties for b\n"
           "    96 bytes stack frame, 100 bytes spill stores, 120 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 96 bytes cumulative stack size\n")
    a, b = parse_ptxas_log(log, "a"), parse_ptxas_log(log, "b")
    assert (a.registers, a.spill_stores, a.spill_loads, a.stack_frame) == (40, 0, 0, 0)
    assert (b.registers, b.spill_stores, b.spill_loads, b.stack_frame) == (255, 100, 120, 96)
    with pytest.raises(ValueError, match="no entry function 'c'"):
        parse_ptxas_log(log, "c")


_SPILL_AND_OVERFLOW = textwrap.dedent("""
    import dataclasses, json
    from nsa_backend.kernels import aot
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # The largest sm_90 prefill tile (too much shared memory for sm_120), and the same kernel capped at
    # 64 registers per thread (spills).
    big = max((j for j in sparse_mla_jobs(90) if j.kind == "prefill"), key=lambda j: j.constexprs["BLOCK_H"])
    over = dataclasses.replace(big, arch=120)
    r_over = over.compile()
    capped = dataclasses.replace(over, options={**over.options, "maxnreg": 64})
    r_cap = capped.compile()
    # The log Triton's own ptxas printed against a second ptxas run on the PTX.
    names = list(capped.signature)
    src = ASTSource(fn=capped.kernel.fn, signature=capped.signature, constexprs=capped.constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in capped.aligned})
    compiled, log = aot._compile_logged(src, GPUTarget("cuda", 120, 32),
                                        {"num_warps": capped.num_warps, "num_stages": capped.num_stages, "maxnreg": 64})
    again = aot.ptxas_resources(compiled.asm["ptx"], compiled.metadata.name, 120)
    rows = [dict(family=j.family, kind=j.kind, config=j.config, arch=120, registers=r.registers,
                 spill_stores=r.spill_stores, spill_loads=r.spill_loads, shared_bytes=r.shared_bytes)
            for j, r in ((over, r_over), (capped, r_cap))]
    print("AOT-ROWS " + json.dumps([rows, bool(log), dataclasses.asdict(again)]))
""")


def test_aot_check_flags_spills_and_oversized_config():
    """An sm_90 tile compiled for sm_120 is over its budget; capped at 64 registers it spills: the
    check names both."""
    rows, logged, again = run_aot_script(_SPILL_AND_OVERFLOW, timeout=600, marker="AOT-ROWS ",
                                         env={"TRITON_DEFAULT_FP_FUSION": "1"})
    over, capped = rows
    assert over["shared_bytes"] > SHARED_MEMORY_LIMIT[120]
    assert any("sm_120" in p and "> 101376 B budget" in p and "prefill" in p for p in problems([over]))
    assert capped["registers"] <= 64 and capped["spill_stores"] > 0
    assert any("spills" in p and "sparse_mla/prefill" in p for p in problems([capped]))
    # Triton's own ptxas log was captured; the fallback (a second ptxas run on the PTX, without Triton's
    # extra allocator flags) sees the same register cap and spills too.
    assert logged
    assert again["registers"] == capped["registers"] and again["spill_stores"] > 0 and again["spill_loads"] > 0
