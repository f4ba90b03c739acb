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
                          "local": 1, "conversions": 1, "idle": 0, "other": 2}
    assert mix.total == 7 and mix.per_mma == 2.5


# ptxas pads with instructions under the never-true predicates !PT / !UPT (e.g. between dependent MMAs): they take
# issue slots and do nothing, so they count as idle, not as the loads or arithmetic they spell
PADDED = textwrap.dedent("""
    .L_x_5:
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0010*/              @!UPT UIADD3 URZ, UPT, UPT, URZ, URZ, URZ ;
        /*0020*/              @!PT LDS RZ, [RZ] ;
        /*0030*/              @P0 LDS R2, [R3] ;
        /*0040*/              @!P1 STS [R3], R2 ;
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;
        /*0060*/              @P2 BRA `(.L_x_5) ;
""")


def test_never_executed_padding_counts_as_idle():
    mix = instruction_mix(PADDED)
    assert mix.loop
    assert mix.counts["idle"] == 2
    assert mix.counts["shared_loads"] == 1 and mix.counts["shared_stores"] == 1 and mix.counts["other"] == 1
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
    assert "| fam/looped | cfg-a | sm_120 | 4 | loop | 2 | 2.5 | 0 | 0 | 1 | 0 | 1 | 1 | 0 | 7 |" in text
    assert "| fam/flat | cfg-b | sm_86 | 8 | kernel | 3 | 2.7 | 1 | 0 | 1 | 1 | 1 | 1 | 0 | 11 |" in text
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
    """The 32-head decode tiles: 136 mma.sync per loop pass of 32 keys (72 for ``q K^T``, 64 for ``P V`` per warp)
    over the bf16 cache, twice that for the fp8 cache's 64 keys per pass, and the fp8 cache adds the e4m3
    conversions and shared-memory stores of the converted keys."""
    got = run_aot_script(_REAL, timeout=600)
    bf16, fp8 = got["bf16"], got["fp8"]
    assert bf16["loop"] and fp8["loop"]
    assert bf16["mma"] == 136 and fp8["mma"] == 2 * 136
    assert fp8["conversions"] > 100 > bf16["conversions"]
    assert fp8["shared_stores"] > bf16["shared_stores"]


# The mma.sync Gluon kernels on sm_120, one build of each kind: CTA barriers and MMAs of the hot loop.
_MMA_V2_BARRIERS = textwrap.dedent("""
    import json
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble, instruction_mix
    out = {}
    for job in sparse_mla_jobs(120):
        if job.kind.endswith("mma_v2") and job.kind not in out:
            mix = instruction_mix(disassemble(job.cubin()))
            out[job.kind] = dict(mix.counts, loop=mix.loop)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mma_v2_tiles_barriers_per_tile_on_sm120():
    """Per 32-key tile (68 MMAs a warp) the bf16 mma.sync kernel (prefill and bf16 decode) passes two CTA barriers,
    the ring's and the score exchange's; the fp8 decode, which also waits for its conversion, three with Triton 3.6 /
    3.8 / 3.9 (four with 3.6 / 3.8 while a tile's copies went into the ring allocation its conversion read). Triton
    inserts a barrier between two accesses to one shared allocation that it cannot tell apart: six and seven with
    Triton 3.6 / 3.8 when the ring's stages and latent groups shared allocations."""
    got = run_aot_script(_MMA_V2_BARRIERS, timeout=600)
    assert set(got) == {"prefill_mma_v2", "decode_bf16_mma_v2", "decode_mma_v2"}, sorted(got)
    per_tile = {}
    for kind, mix in got.items():
        assert mix["loop"] and mix["mma"] % 68 == 0, (kind, mix)
        per_tile[kind] = mix["barriers"] / (mix["mma"] // 68)
    assert per_tile["prefill_mma_v2"] == per_tile["decode_bf16_mma_v2"] == 2, per_tile
    assert per_tile["decode_mma_v2"] == 3, per_tile


# The fp8 decode on sm_120 (arbitrary scales, one split): per stretch of SASS between two CTA barriers, its cp.async
# copies (LDGSTS), MMAs and fp32 -> bf16 conversions (F2FP).
_FP8_DECODE_STRETCHES = textwrap.dedent("""
    import json, re
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble
    job = next(j for j in sparse_mla_jobs(120) if j.kind == "decode_mma_v2" and not j.constexprs["SPLIT"]
               and not j.constexprs["POW2_SCALES"])
    stretches = [dict(copies=0, mma=0, conversions=0)]
    for m in re.finditer(r"^\\s*/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_.]*)", disassemble(job.cubin()),
                         re.M):
        op = m.group(1)
        if op.startswith("BAR.SYNC"):
            stretches.append(dict(copies=0, mma=0, conversions=0))
        for key, prefix in (("copies", "LDGSTS"), ("mma", "HMMA"), ("conversions", "F2FP")):
            stretches[-1][key] += op.startswith(prefix)
    print(json.dumps(stretches))
""")


@pytest.mark.slow
def test_mma_v2_fp8_decode_copies_latent_bytes_after_the_conversion_on_sm120():
    """The fp8 decode issues a tile's latent and scale copies right after the barrier that ends the conversion of the
    tile whose buffer they take, so that they stay in flight through that tile's products: the conversion's stretch
    of the hot loop issues one copy a thread (the rope values of a tile ahead) and the next stretch, where the score
    MMAs start, the latent bytes' four and the scales' one. Copying the whole row there (six) keeps one tile of
    copies in flight."""
    stretches = run_aot_script(_FP8_DECODE_STRETCHES, timeout=600)
    i = max(range(len(stretches)), key=lambda k: stretches[k]["conversions"])
    conversion, after = stretches[i], stretches[i + 1]
    assert conversion["conversions"] >= 64 and conversion["mma"] == 0, stretches
    assert conversion["copies"] == 1, stretches
    assert after["copies"] == 5 and after["mma"] > 0, stretches


# The mma.sync Gluon kernels on sm_120, one build of each kind: the warp votes, and the runs of FMULs that open right
# after a predicated branch (the lazy rescale's skippable products), with their lengths.
_MMA_V2_RESCALE = textwrap.dedent("""
    import json, re
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble
    out = {}
    for job in sparse_mla_jobs(120):
        if job.kind.endswith("mma_v2") and job.kind not in out:
            ops = [(m.group(1) or "", m.group(2)) for m in re.finditer(
                r"^\\s*/\\*[0-9a-f]+\\*/\\s+(@!?U?P[T0-9]+\\s+)?([A-Z][A-Z0-9_.]*)", disassemble(job.cubin()), re.M)]
            runs = []
            for i, (pred, op) in enumerate(ops[:-1]):
                if pred and op == "BRA" and ops[i + 1][1].startswith("FMUL"):
                    n = 0
                    while ops[i + 1 + n][1].startswith("FMUL"):
                        n += 1
                    runs.append(n)
            out[job.kind] = dict(votes=sum(op.startswith("VOTE") for _, op in ops), skippable=runs)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mma_v2_lazy_rescale_branches_on_sm120():
    """The fp8 decode rescales ``O`` lazily (``LAZY_RESCALE``): one warp vote per tile and four predicated branches,
    each around one accumulator's 16 products a thread. The bf16 kernel (prefill and bf16 decode) rescales every tile:
    no vote, no branch around its products."""
    got = run_aot_script(_MMA_V2_RESCALE, timeout=600)
    assert set(got) == {"prefill_mma_v2", "decode_bf16_mma_v2", "decode_mma_v2"}, sorted(got)
    assert got["decode_mma_v2"]["votes"] == 1 and got["decode_mma_v2"]["skippable"] == [16] * 4, got
    for kind in ("prefill_mma_v2", "decode_bf16_mma_v2"):
        assert got[kind]["votes"] == 0 and got[kind]["skippable"] == [], (kind, got[kind])


# The mma.sync Gluon kernels on sm_120, one build of each kind: the longest run of MMAs in which each takes the one
# issued before it as its accumulator (each waits for the last's result, with no other MMA issued in between).
_MMA_V2_CHAINS = textwrap.dedent("""
    import json, re
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble
    out = {}
    for job in sparse_mla_jobs(120):
        if job.kind.endswith("mma_v2") and job.kind not in out:
            longest = run = 0
            last = None
            for m in re.finditer(r"HMMA\\.\\S+\\s+(R\\d+),[^,]+,[^,]+,\\s*(R\\d+|RZ)", disassemble(job.cubin())):
                run = run + 1 if m.group(2) == last else 1
                longest, last = max(longest, run), m.group(1)
            out[job.kind] = longest
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mma_v2_score_chains_interleave_on_sm120():
    """The bf16 kernel (prefill and bf16 decode) takes the rope part's scores in an accumulator of their own
    (``ROPE_CHAIN``): its ``q K^T`` MMAs interleave, at most four in a row each waiting for the one before. With the
    rope's MMAs added to the first latent group's, ptxas issued that group's and the rope's as one chain of 10-12
    (Triton 3.6 / 3.8 / 3.9), as it still does in the fp8 decode, where ``ROPE_CHAIN`` measured no faster."""
    got = run_aot_script(_MMA_V2_CHAINS, timeout=600)
    assert set(got) == {"prefill_mma_v2", "decode_bf16_mma_v2", "decode_mma_v2"}, sorted(got)
    assert got["prefill_mma_v2"] <= 4 and got["decode_bf16_mma_v2"] <= 4, got


# The shipped fp8 decode tile with the most heads whose build sets the flag named by argv[1] (a constexpr of the
# kernel) on sm_<argv[2]> (default 120), compiled as shipped ("on") and with the flag off ("off"): its hot loop's
# instruction mix, spill and shared memory.
_KEYS_FLAG = textwrap.dedent("""
    import dataclasses, json, sys
    from nsa_backend.kernels.aot_registry import sparse_mla_jobs
    from nsa_backend.kernels.aot_sass import disassemble, instruction_mix
    flag = sys.argv[1]
    arch = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    jobs = [j for j in sparse_mla_jobs(arch) if j.kind == "decode" and j.constexprs["KV_FP8"] and j.constexprs[flag]]
    job = max(jobs, key=lambda j: j.constexprs["BLOCK_H"])
    off = dataclasses.replace(job, constexprs={**job.constexprs, flag: False})
    out = {}
    for name, j in (("on", job), ("off", off)):
        mix = instruction_mix(disassemble(j.cubin()))
        res = j.compile()
        out[name] = dict(mix.counts, loop=mix.loop, block_h=j.constexprs["BLOCK_H"], spill=res.spill_stores,
                         shared=res.shared_bytes)
    print(json.dumps(out))
""")


def _keys_flag(flag: str, block_h: int, arch: int = 120) -> tuple[dict, dict, dict[str, int]]:
    """``_KEYS_FLAG`` for ``flag`` on ``sm_<arch>``: the tile built with it (``on``) and without (``off``), checked
    to be the ``block_h``-head tile with a loop and the same MMAs either way, and the instructions per loop pass
    of each."""
    got = run_aot_script(_KEYS_FLAG, flag, str(arch), timeout=600)
    on, off = got["on"], got["off"]
    assert on["block_h"] == block_h and on["loop"] and off["loop"]
    assert on["mma"] == off["mma"]
    counted = ("loop", "block_h", "spill", "shared")
    return on, off, {k: sum(v for c, v in d.items() if c not in counted) for k, d in got.items()}


@pytest.mark.slow
def test_shared_keys_tile_stores_its_keys_once_on_sm120():
    """The fp8 decode tile that shares its keys (the 16-head tile of the 100 KiB parts) converts each latent group
    once into shared memory for both MMAs: fewer shared loads, barriers and instructions per loop pass than the
    same tile converting per MMA (685 against 902 with Triton 3.9), and no spill in its loop."""
    shared, plain, total = _keys_flag("SHARE_KEYS", 16)
    assert shared["shared_loads"] < plain["shared_loads"] and shared["barriers"] < plain["barriers"], (shared, plain)
    assert total["on"] <= 0.85 * total["off"], total
    assert shared["local"] == 0


@pytest.mark.slow
def test_reread_keys_tile_spills_less_on_sm120():
    """The 32-head fp8 decode tile of the 100 KiB parts (64 keys per pass) reads each latent group again for
    ``P V`` instead of holding a converted copy across the softmax: with Triton 3.9, 102 local accesses per loop
    pass and 520 B of spill against 782 and 2096 B when the copy is held, the same MMAs, and its shared memory
    still fits two programs per 100 KiB SM."""
    reread, held, _ = _keys_flag("REREAD_KEYS", 32)
    assert 4 * reread["local"] <= held["local"], (reread, held)
    assert reread["global_loads"] > held["global_loads"]
    assert 3 * reread["spill"] <= held["spill"], (reread, held)
    assert 2 * reread["shared"] <= 100 * 1024


@pytest.mark.slow
def test_pow2_dequant_tile_converts_with_fewer_instructions_on_sm86():
    """On sm_86 (no fp8 unit) the 32-head fp8 decode tile dequantises power-of-two scales (``kv_scale_format="pow2"``)
    with integer bits and one bf16 product per pair of keys instead of decoding e4m3 into fp16 and multiplying in
    fp32: with Triton 3.9, 4026 instructions per loop pass against 6810, 44 conversions against 264 and 272 B of
    spill against 556, the same MMAs."""
    pow2, general, total = _keys_flag("POW2_SCALES", 32, arch=86)
    assert pow2["conversions"] < general["conversions"] and pow2["spill"] < general["spill"], (pow2, general)
    assert total["on"] <= 0.7 * total["off"], total


_HEAD_SLICES = textwrap.dedent(r"""
    import dataclasses, json, re
    from nsa_backend.kernels.aot import compile_source
    from nsa_backend.kernels.aot_registry import indexer_jobs
    from nsa_backend.kernels.aot_sass import disassemble, instruction_mix
    job = next(j for j in indexer_jobs(120) if j.kind == "paged" and j.constexprs["HP"] == 64
               and j.constexprs["NP"] == 1 and j.constexprs["D"] == 128)
    whole = dataclasses.replace(job, constexprs={**job.constexprs, "HEAD_SLICES": 1})
    out = {}
    for name, j in (("sliced", job), ("whole", whole)):
        compiled, _, _ = compile_source(j.kernel, j.signature, j.constexprs, j.arch, j.num_warps, j.num_stages,
                                        aligned=j.aligned, options=j.options)
        warps = re.search(r"nvidia_mma<\{versionMajor = 2.*?warpsPerCTA = \[(\d+), (\d+)\]",
                          compiled.asm["ttgir"])
        mix = instruction_mix(disassemble(compiled.asm["cubin"]))
        out[name] = dict(mix.counts, loop=mix.loop, slices=j.constexprs["HEAD_SLICES"],
                         warps=[int(warps.group(1)), int(warps.group(2))])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_head_slices_keep_each_head_sum_in_one_warp_on_sm120():
    """The 64-head paged logits tile of sm_120 multiplies two 32-head slices: Triton then spreads the four warps
    along the keys only ([4, 1]; one 64 x 64 product is spread 2 x 2, and each key's head sum crosses warps), and
    the loop passes fewer barriers and shared stores than the same tile in one product."""
    got = run_aot_script(_HEAD_SLICES, timeout=600)
    sliced, whole = got["sliced"], got["whole"]
    assert sliced["slices"] == 2 and sliced["loop"] and whole["loop"]
    assert sliced["warps"] == [4, 1] and whole["warps"] == [2, 2], (sliced["warps"], whole["warps"])
    assert sliced["mma"] == whole["mma"]
    assert sliced["barriers"] < whole["barriers"] and sliced["shared_stores"] < whole["shared_stores"], (sliced, whole)


@pytest.mark.parametrize("module", ["aot_sass", "aot_report"])
@pytest.mark.parametrize("flag,value", [("--family", "nope"), ("--arch", "75")])
def test_bad_flags_exit_2_naming_the_flag(module, flag, value):
    proc = subprocess.run([sys.executable, "-m", f"nsa_backend.kernels.{module}", flag, value, "--out", "/dev/null"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and f"error: {flag}: " in proc.stderr.splitlines()[-1]
