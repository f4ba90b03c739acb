"""Roofline share of rows bounded by memory and compute (``nsa_backend.bench.roofline``).

References: the FLOPs of the paged logits against a brute-force count of visible (row, key) pairs
(loops over the contract, and the finite entries of the reference op's output); ``of_roofline`` and
``ceiling_of_copy`` against ``max(bytes / copy, flops / peak)`` worked out by hand; the command on a
small results.json written here, bad inputs in a subprocess (exit 2, one line, no traceback).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_backend import reference as ref
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.roofline import ceiling_of_copy, main, of_roofline, paged_logits_flops
from nsa_backend.bench.runner import compute_ratios
from nsa_backend.bench.schema import validate


def _brute_pairs(B: int, L: int, next_n: int) -> int:
    # The contract, 1-D context_lens: row j of next_n is the query at L - next_n + j, seeing t <= it.
    return sum(1 for _ in range(B) for j in range(next_n) for t in range(L) if t <= L - next_n + j)


@pytest.mark.parametrize("B, L, next_n, H, D", [
    pytest.param(1, 1, 1, 1, 1, id="one-key"),
    pytest.param(3, 7, 2, 4, 16, id="odd-L-mtp2"),
    pytest.param(2, 5, 4, 2, 8, id="next_n-4"),
    pytest.param(2, 2, 3, 3, 8, id="L-below-next_n"),
    pytest.param(4, 0, 2, 2, 8, id="empty-context"),
    pytest.param(128, 4096, 2, 64, 128, id="bench-shape"),
])
def test_paged_logits_flops_matches_brute_force(B, L, next_n, H, D):
    pairs = _brute_pairs(min(B, 2), L, next_n) * B // min(B, 2)  # every request has the same context
    assert paged_logits_flops(B, L, next_n, H, D) == 2 * H * D * pairs


@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_paged_logits_flops_counts_the_reference_ops_visible_entries(next_n):
    # The bench's own inputs (context_lens = L for every request) through the reference op: every
    # visible (row, key) pair is a finite logit, every hidden one -inf.
    B, L, H, D = 2, 128, 4, 32
    q, cache, w, ctx, table = paged_inputs(B, L, next_n, H, D, device="cpu")
    logits = ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, torch.zeros(1, 2, dtype=torch.int32), L)
    visible = int(torch.isfinite(logits).sum())
    assert paged_logits_flops(B, L, next_n, H, D) == 2 * H * D * visible


def test_paged_logits_flops_rejects_bad_arguments():
    with pytest.raises(ValueError, match="B: expected an integer >= 0"):
        paged_logits_flops(-1, 8, 1, 2, 2)
    with pytest.raises(ValueError, match="next_n: expected an integer >= 1"):
        paged_logits_flops(1, 8, 0, 2, 2)
    with pytest.raises(ValueError, match="H: expected an integer"):
        paged_logits_flops(1, 8, 1, 2.0, 2)


def test_of_roofline_takes_the_binding_side():
    # Hand-made op: 1e9 bytes and 4e12 FLOPs; copy 1000 GB/s (1 ms), peak 1000 TFLOP/s (4 ms).
    nbytes, flops, copy, peak = 1e9, 4e12, 1000.0, 1000.0
    for ms in (8.0, 4.0, 5.0):
        ratios = {"of_copy": nbytes / ms / 1e6 / copy, "of_fp8_mm": flops / ms / 1e9 / peak}
        ideal = max(nbytes / (copy * 1e9), flops / (peak * 1e12)) * 1e3  # ms at the limits
        assert of_roofline(ratios) == pytest.approx(ideal / ms)
    # compute-bound: the compute fraction wins; memory-bound: of_copy wins
    assert of_roofline({"of_copy": 0.2, "of_bf16_mm": 0.6}) == pytest.approx(0.6)
    assert of_roofline({"of_copy": 0.8, "of_fp8_mm": 0.3, "vs_torch": 9.0}) == pytest.approx(0.8)
    # a missing side, or an op whose compute limit is unknown (both compute ratios): no share
    assert of_roofline({"of_copy": 0.8}) is None
    assert of_roofline({"of_fp8_mm": 0.8, "of_copy": None}) is None
    assert of_roofline({"of_copy": 0.8, "of_bf16_mm": 0.1, "of_fp8_mm": 0.05}) is None


def test_ceiling_of_copy():
    # compute-bound: t_mem 1 ms, t_comp 4 ms -> a kernel at the limits reaches a quarter of the copy rate
    assert ceiling_of_copy(4e12, 1e9, 1000.0, 1000.0) == pytest.approx(0.25)
    # memory-bound (t_comp 0.5 ms < t_mem 1 ms) and no FLOPs at all: the copy rate itself
    assert ceiling_of_copy(5e11, 1e9, 1000.0, 1000.0) == 1.0
    assert ceiling_of_copy(0, 1e9, 1000.0, 1000.0) == 1.0
    # the paged logits at next_n 2 on the proxy's limits: 2 * 16384 FLOPs per key against 132 bytes
    flops, nbytes = paged_logits_flops(128, 4096, 2, 64, 128), 128 * 4096 * 132
    want = (nbytes / 4265e9) / (flops / 488.9e12)
    assert ceiling_of_copy(flops, nbytes, 4265.0, 488.9) == pytest.approx(want)
    assert 0.45 < want < 0.47
    with pytest.raises(ValueError, match="nbytes: expected a finite number > 0"):
        ceiling_of_copy(1.0, 0.0, 1000.0, 1000.0)
    with pytest.raises(ValueError, match="peak_tflops"):
        ceiling_of_copy(1.0, 1.0, 1000.0, float("nan"))


def _row(op, impl, ms, shape="S=1", tflops=None, gbps=None, ratios=None, **extra):
    return {"family": "fam", "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": tflops,
            "gbps": gbps, "ratios": ratios or {}, **extra}


def test_compute_ratios_adds_of_roofline_only_with_both_sides():
    limits = {"copy_gbps": 4000.0, "bf16_tflops": 800.0, "fp8_tflops": 1600.0}
    rows = [
        _row("fp8_paged_mqa_logits", "triton", 1.0, tflops=800.0, gbps=1000.0,
             limit=["copy_gbps", "fp8_tflops"]),                                   # compute-bound
        _row("sparse_mla_decode", "triton", 1.0, tflops=80.0, gbps=3000.0),        # memory-bound (OP_LIMITS)
        _row("fp8_paged_mqa_logits", "read_kv", 1.0, gbps=3000.0, limit=["copy_gbps"]),  # memory side only
        _row("fp8_paged_mqa_logits", "torch", 1.0, gbps=3000.0),                   # no FLOPs: no compute side
        _row("fp8_mqa_logits", "triton", 1.0, tflops=800.0, gbps=1000.0),          # compute limit only
        _row("topk_indices", "triton", 1.0, gbps=2000.0, ratios={"of_copy": 0.9}),
    ]
    out = compute_ratios(rows, limits)
    assert out[0]["ratios"]["of_roofline"] == pytest.approx(0.5)
    assert out[1]["ratios"]["of_roofline"] == pytest.approx(0.75)
    for r in out[2:]:
        assert "of_roofline" not in r["ratios"], r
    # the other ratios are as before
    assert out[0]["ratios"]["of_copy"] == pytest.approx(0.25) and out[0]["ratios"]["of_fp8_mm"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------

PAGED = {"B": 128, "context": 4096, "next_n": 2, "H": 64, "D": 128, "page": 64}
# The indexer family's own run measured copy 2000 GB/s and fp8 200 TFLOP/s; the file's limits
# (another run's) say 4000 / 400: the table must use the family's.
FAM_COPY, FAM_FP8, TOP = 2000.0, 200.0, {"copy_gbps": 4000.0, "bf16_tflops": 300.0, "fp8_tflops": 400.0}


def _paged_flops_bytes() -> tuple[float, float]:
    B, L, n, H, D = (PAGED[k] for k in ("B", "context", "next_n", "H", "D"))
    # closed form of the visible pairs (L >= next_n), not the module's loop
    return 2.0 * H * D * B * (n * L - n * (n - 1) / 2), float(B * L * (D + 4))


def _results() -> dict:
    flops, nbytes = _paged_flops_bytes()
    t_comp_ms = flops / (FAM_FP8 * 1e9)

    def paged(impl: str, ms: float) -> dict:
        gbps = nbytes / ms / 1e6
        return {"family": "indexer", "op": "fp8_paged_mqa_logits", "shape": dict(PAGED), "impl": impl, "ms": ms,
                "tflops": None, "gbps": gbps, "ratios": {"of_copy": gbps / FAM_COPY}, "limit": ["copy_gbps"]}

    rows = [
        paged("triton-graph", 2 * t_comp_ms),   # half the compute-bound ideal
        paged("read_kv-graph", t_comp_ms / 4),  # a read faster than the op's ideal
        {"family": "indexer", "op": "fp8_mqa_logits", "shape": {"S": 8}, "impl": "triton", "ms": 1.0,
         "tflops": 100.0, "gbps": None, "ratios": {"of_fp8_mm": 100.0 / FAM_FP8}},
        {"family": "sparse_mla", "op": "sparse_mla_decode", "shape": {"B": 32, "h_q": 16}, "impl": "triton",
         "ms": 0.05, "tflops": 30.0, "gbps": 2000.0, "ratios": {"of_copy": 0.5, "of_bf16_mm": 0.1}},
        {"family": "eager", "op": "sparse_mla_decode", "shape": {"B": 32}, "impl": "host", "ms": 0.3,
         "tflops": None, "gbps": None, "ratios": {}},
    ]
    families = {f: {"status": "ok", "source": "module", "rows": 1, "seconds": 1.0, "note": None}
                for f in ("indexer", "sparse_mla", "eager")}
    env = {"gpu_name": "NVIDIA H200", "capability": "9.0", "driver": None, "cuda": None, "python": "3",
           "platform": "x", "torch": "2", "triton": None, "nsa_backend": "0", "native": {}, "git_commit": None,
           "git_dirty": None}
    result = {"schema_version": 1, "created": "2026-01-01T00:00:00+00:00", "command": "python -m nsa_backend.bench",
              "argv": [], "device": "cuda", "quick": False, "environment": env, "limits": dict(TOP),
              "limit_sizes": {}, "families": families, "rows": rows}
    validate(result)
    return result


def _table(text: str, op: str) -> dict[str, list[str]]:
    """impl -> cells of the rows of ``op``."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == op:
            out[cells[2]] = cells
    return out


def test_command_writes_the_table(tmp_path):
    src = tmp_path / "run"
    src.mkdir()
    (src / "results.json").write_text(json.dumps(_results()))
    out = tmp_path / "roofline.md"
    assert main([str(src), "--out", str(out)]) == 0
    text = out.read_text()
    # header: the source file, its limits, the exact command
    assert f"Source: `{src / 'results.json'}`" in text
    assert "copy 4000 GB/s, bf16 mm 300 TFLOP/s, fp8 mm 400 TFLOP/s" in text
    assert f"Command: `python -m nsa_backend.bench.roofline {src} --out {out}`" in text
    # the indexer family's limits are read back from its rows, not the file's
    assert "copy 2000 GB/s, fp8 mm 200 TFLOP/s (the family's own run" in text
    flops, nbytes = _paged_flops_bytes()
    ceiling = f"{100 * (nbytes / FAM_COPY) / (flops / FAM_FP8 / 1e3):.1f}%"
    paged = _table(text, "fp8_paged_mqa_logits")
    assert set(paged) == {"triton-graph", "read_kv-graph"}
    t_comp_ms = flops / (FAM_FP8 * 1e9)
    ms = 2 * t_comp_ms
    of_copy, of_fp8 = nbytes / ms / 1e6 / FAM_COPY, flops / ms / 1e9 / FAM_FP8
    assert paged["triton-graph"][4:] == [f"{100 * of_copy:.1f}%", f"{100 * of_fp8:.1f}%", f"{100 * of_fp8:.1f}%",
                                         "fp8 mm", ceiling]
    assert paged["triton-graph"][6] == "50.0%"
    # the read floor does no arithmetic: no FLOPs counted, so only its share of the copy rate
    assert paged["read_kv-graph"][4:] == [f"{100 * nbytes / (t_comp_ms / 4) / 1e6 / FAM_COPY:.1f}%", "", "", "", ""]
    decode = _table(text, "sparse_mla_decode")
    assert list(decode) == ["triton"]  # the eager host-time row is left out
    assert decode["triton"][4:] == ["50.0%", "10.0%", "50.0%", "copy", "100.0%"]
    assert "eager sparse_mla_decode (1 row)" in text
    assert "fp8_mqa_logits |" not in text  # compute-bound only: not in the table


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsa_backend.bench.roofline", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_command_prints_to_stdout(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_results()))
    proc = _run_cli(str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stderr
    assert _table(proc.stdout, "fp8_paged_mqa_logits")["triton-graph"][6] == "50.0%"


@pytest.mark.parametrize("case, expect", [
    ("missing", "expected a results.json file or a directory holding one"),
    ("empty-dir", "expected a results.json file or a directory holding one"),
    ("not-json", "expected JSON in"),
    ("schema", "expected a results.json following nsa_backend.bench.schema"),
])
def test_command_bad_input_exit_2_one_line(tmp_path, case, expect):
    if case == "missing":
        arg = tmp_path / "nope.json"
    elif case == "empty-dir":
        arg = tmp_path
    elif case == "not-json":
        arg = tmp_path / "results.json"
        arg.write_text("{not json")
    else:
        bad = _results()
        del bad["rows"][0]["impl"]
        arg = tmp_path / "results.json"
        arg.write_text(json.dumps(bad))
    proc = _run_cli(str(arg), "--out", str(tmp_path / "out.md"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "RESULTS" in lines[0] and expect in lines[0] and str(Path(arg).name) in lines[0]
    assert not (tmp_path / "out.md").exists() and proc.stdout == ""
