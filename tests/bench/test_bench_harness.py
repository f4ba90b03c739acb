"""The benchmark harness on CPU: quick mode end to end, the JSON schema, the ratio math.

Reference for the ratios: ``vs_<impl> = ms(<impl>) / ms(ours)`` and ``of_<limit> = rate / limit``
computed by hand on synthetic rows. Family modules are replaced by in-memory modules where a
test needs rows of a GPU run (triton, flash_mla, reference) without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.machinery
import json
import sys
import time
import types

import pytest
import torch

from nsa_backend.bench import FAMILIES, builtin
from nsa_backend.bench.cli import add_bench_parser, main, run_bench
from nsa_backend.bench.runner import (
    _run_family,
    command_line,
    compute_ratios,
    device_slug,
    normalize_row,
    run_suite,
    select,
    write_plots,
)
from nsa_backend.bench.schema import validate
from nsa_backend.bench.timing import bench_ms, gbps, tflops

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ARGV = ["nsa-backend", "bench", "--quick"]

try:
    import matplotlib  # noqa: F401

    HAS_MPL = True
except ImportError:
    HAS_MPL = False


def _row(op, impl, ms, shape="S=1", tflops=None, gbps=None, ratios=None, **extra):
    return {"family": "fam", "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": tflops,
            "gbps": gbps, "ratios": ratios or {}, **extra}


def _fake_family(monkeypatch, name, run):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.run = run
    monkeypatch.setitem(sys.modules, name, module)
    return name


def _check_files(out, families):
    data = json.loads((out / "results.json").read_text())
    validate(data)
    md = (out / "results.md").read_text()
    assert md.startswith("# nsa-backend benchmark results")
    for family in families:
        assert f"## {family}" in md
    assert (out / "results.csv").stat().st_size > 0
    if HAS_MPL:
        for family in families:
            png = (out / f"{family}.png").read_bytes()
            assert png.startswith(PNG_MAGIC) and len(png) > 1000, family
    return data, md


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU quick mode (the GPU run is the full suite)")
def test_quick_run_every_family(tmp_path):
    result, out = run_suite(quick=True, out=tmp_path, progress=False, argv=ARGV)
    validate(result)
    data, md = _check_files(out, FAMILIES)
    assert data["command"] == "nsa-backend bench --quick"
    assert data["device"] == "cpu" and data["quick"] is True
    assert set(data["limits"]) == {"copy_gbps", "bf16_tflops", "fp8_tflops"}
    assert data["limits"]["copy_gbps"] > 0 and data["limits"]["bf16_tflops"] > 0
    assert list(data["families"]) == list(FAMILIES)
    for family, info in data["families"].items():
        assert info["status"] == "ok", (family, info)
        rows = [r for r in data["rows"] if r["family"] == family]
        assert rows and info["rows"] == len(rows)
        assert all(r["ms"] and r["ms"] > 0 for r in rows if "note" not in r), family
    assert any(r["impl"] == "reference" and r["ms"] for r in data["rows"])
    assert "| op | shape | impl | ms | TFLOP/s | GB/s" in md


def test_builtin_case_for_every_family(tmp_path):
    # the op families (the eager and peers families time those ops and have no built-in case)
    absent = {f: f"nsa_backend.bench._absent_{f}" for f in builtin.CASES}
    result, _ = run_suite(list(builtin.CASES), quick=True, out=tmp_path, plots=False, progress=False, argv=ARGV,
                          modules=absent)
    assert list(result["families"]) == [f for f in FAMILIES if f in builtin.CASES]
    for family, info in result["families"].items():
        assert (info["status"], info["source"]) == ("ok", "builtin"), family
        impls = {r["impl"]: r for r in result["rows"] if r["family"] == family}
        assert {"reference", "torch"} <= set(impls), family
        assert all(r["ms"] and r["ms"] > 0 for r in impls.values()), family


def test_missing_module():
    limits = {"copy_gbps": 1.0, "bf16_tflops": 1.0, "fp8_tflops": None}
    rows, info = _run_family("topk", "nsa_backend.bench._absent_topk", False, limits, None)
    assert rows == [] and (info["status"], info["source"]) == ("skipped", "none")
    assert "no module nsa_backend.bench._absent_topk" in info["note"]
    rows, info = _run_family("topk", "nsa_backend.bench._absent_topk", True, limits, None)
    assert rows and (info["status"], info["source"]) == ("ok", "builtin")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")
def test_cpu_always_quick(tmp_path):
    with pytest.warns(RuntimeWarning, match="no CUDA GPU"):
        result, _ = run_suite(["topk"], quick=False, out=tmp_path, plots=False, progress=False, argv=ARGV)
    assert result["quick"] is True


def test_gpu_like_rows_through_runner(monkeypatch, tmp_path):
    def run(quick, limits):
        assert quick is True and set(limits) == {"copy_gbps", "bf16_tflops", "fp8_tflops"}
        shape = {"s_q": 4096, "h_q": 64}
        return [
            _row("flash_mla_sparse_fwd", "triton", 2.0, shape, tflops=400.0, ratios={"custom": 3.0}),
            _row("flash_mla_sparse_fwd", "flash_mla", 1.6, shape, tflops=500.0),
            _row("flash_mla_sparse_fwd", "reference", 40.0, shape, tflops=20.0),
            _row("sparse_mla_decode", "triton", 0.1, "B=64", gbps=torch.tensor(3000.0), limit="copy_gbps"),
            _row("sparse_mla_decode", "flash_mla", None, "B=64", note="not importable"),
        ]

    name = _fake_family(monkeypatch, "fake_sparse_mla_bench", run)
    result, out = run_suite(["sparse_mla"], quick=True, out=tmp_path, progress=False, argv=ARGV,
                            modules={"sparse_mla": name})
    _, md = _check_files(out, ["sparse_mla"])
    rows = result["rows"]
    bf16 = result["limits"]["bf16_tflops"]
    tri = rows[0]["ratios"]
    assert tri["vs_flash_mla"] == pytest.approx(0.8)
    assert tri["vs_reference"] == pytest.approx(20.0)
    assert tri["of_bf16_mm"] == pytest.approx(400.0 / bf16)
    assert tri["custom"] == 3.0
    assert "vs_triton" not in rows[1]["ratios"]
    assert rows[3]["gbps"] == 3000.0 and rows[3]["limit"] == ["copy_gbps"]
    assert set(rows[3]["ratios"]) == {"of_copy"}  # the failed flash_mla row gives no vs_ ratio
    assert "| 0.8x |" in md and "| 20x |" in md and "not importable" in md


def test_failing_family_is_reported(monkeypatch, tmp_path):
    def run(quick, limits):
        raise RuntimeError("kernel exploded")

    name = _fake_family(monkeypatch, "fake_failing_bench", run)
    result, out = run_suite(["mhc", "topk"], quick=True, out=tmp_path, plots=False, progress=False, argv=ARGV,
                            modules={"mhc": name})
    assert result["families"]["mhc"]["status"] == "error"
    assert "kernel exploded" in result["families"]["mhc"]["note"]
    assert result["families"]["topk"]["status"] == "ok"
    validate(json.loads((out / "results.json").read_text()))


def test_cli_main(tmp_path):
    out = tmp_path / "res"
    assert main(["--quick", "--ops", "topk_indices", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert list(data["families"]) == ["topk"]
    assert {r["op"] for r in data["rows"]} == {"topk_indices"}
    assert not list(out.glob("*.png"))
    assert main(["--ops", "nope", "--out", str(out), "--no-progress"]) == 2
    # Tables and plots again from the JSON alone (runs on machines without matplotlib).
    again = tmp_path / "again"
    assert main(["--replot", str(out / "results.json"), "--out", str(again)]) == 0
    assert (again / "results.md").read_text() == (out / "results.md").read_text()
    if HAS_MPL:
        assert (again / "topk.png").read_bytes().startswith(PNG_MAGIC)
    assert main(["--replot", str(tmp_path / "missing")]) == 2


def test_bench_subcommand_parser():
    parser = argparse.ArgumentParser(prog="nsa-backend")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick", "--ops", "topk,mhc", "indexer", "--out", "x"])
    assert args.func is run_bench
    assert (args.quick, args.ops, args.out, args.plots, args.progress) == (True, ["topk,mhc", "indexer"], "x",
                                                                          True, True)
    assert command_line(["/venv/bin/nsa-backend", "bench", "--out", "a b"]) == "nsa-backend bench --out 'a b'"
    assert command_line(["/x/nsa_backend/bench/__main__.py", "--quick"]) == "python -m nsa_backend.bench --quick"


# ----------------------------------------------------------------------------------------------
# Ratios, rows, schema
# ----------------------------------------------------------------------------------------------

def test_ratio_math_on_synthetic_rows():
    limits = {"copy_gbps": 4000.0, "bf16_tflops": 800.0, "fp8_tflops": 1600.0}
    rows = [
        _row("fp8_mqa_logits", "triton", 2.0, tflops=400.0, gbps=100.0),
        _row("fp8_mqa_logits", "deep_gemm", 1.0, tflops=800.0),
        _row("fp8_mqa_logits", "reference", 8.0, tflops=100.0),
        _row("fp8_mqa_logits", "triton", 3.0, shape="S=2", tflops=10.0),  # another shape: its own group
        _row("topk_indices", "triton", 0.5, gbps=1000.0, ratios={"of_copy": 0.9}),  # family value kept
        _row("topk_indices", "torch", 2.0, gbps=250.0, ratios={"of_copy": None, "extra": None}),
        _row("my_op", "triton", 1.0, tflops=80.0, gbps=400.0),  # unknown op: every limit
        _row("my_op", "torch", 4.0, limit=["bf16_tflops"], tflops=8.0),
    ]
    out = compute_ratios(rows, limits)
    assert out[0]["ratios"] == pytest.approx({"vs_deep_gemm": 0.5, "vs_reference": 4.0, "of_fp8_mm": 0.25})
    assert out[1]["ratios"] == pytest.approx({"of_fp8_mm": 0.5})
    assert out[2]["ratios"] == pytest.approx({"of_fp8_mm": 100.0 / 1600.0})
    assert out[3]["ratios"] == pytest.approx({"of_fp8_mm": 10.0 / 1600.0})
    assert out[4]["ratios"] == pytest.approx({"vs_torch": 4.0, "of_copy": 0.9})
    assert out[5]["ratios"] == pytest.approx({"of_copy": 250.0 / 4000.0, "extra": None})  # None never overrides
    assert out[6]["ratios"] == pytest.approx({"vs_torch": 4.0, "of_copy": 0.1, "of_bf16_mm": 0.1,
                                              "of_fp8_mm": 0.05})
    assert out[7]["ratios"] == pytest.approx({"of_bf16_mm": 0.01})
    assert rows[0]["ratios"] == {}  # inputs untouched
    # Limits that were not measured give no ratio.
    none = compute_ratios(rows[:2], {"copy_gbps": None, "bf16_tflops": None, "fp8_tflops": None})
    assert none[0]["ratios"] == pytest.approx({"vs_deep_gemm": 0.5})


def test_normalize_row():
    row = normalize_row({"op": "x", "impl": "triton", "ms": torch.tensor(2.0), "tflops": float("nan"),
                         "shape": {"S": 3}, "limit": "copy_gbps", "ratios": {"a": 1}}, "indexer")
    assert row == {"family": "indexer", "op": "x", "impl": "triton", "shape": {"S": 3}, "ms": 2.0,
                   "tflops": None, "gbps": None, "ratios": {"a": 1.0}, "limit": ["copy_gbps"]}
    with pytest.raises(ValueError, match="missing 'ms'"):
        normalize_row({"op": "x", "impl": "triton"}, "indexer")
    with pytest.raises(ValueError, match="unknown limit"):
        normalize_row({"op": "x", "impl": "t", "ms": 1.0, "limit": "hbm"}, "indexer")
    with pytest.raises(ValueError, match="expected a number"):
        normalize_row({"op": "x", "impl": "t", "ms": "fast"}, "indexer")


def test_device_slug():
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device_slug(None) == "cpu"


def test_select_ops():
    assert select(None) == (list(FAMILIES), {})
    assert select(["mhc", "topk"]) == (["topk", "mhc"], {})
    assert select(["fp8_mqa_logits", "topk"]) == (["indexer", "topk"], {"indexer": {"fp8_mqa_logits"}})
    assert select(["indexer", "fp8_mqa_logits"]) == (["indexer"], {})
    with pytest.raises(ValueError, match="unknown family or op"):
        select(["attention"])


def _valid_result():
    return {
        "schema_version": 1, "created": "2026-11-30T00:00:00+00:00", "command": "nsa-backend bench",
        "argv": ["nsa-backend", "bench"], "device": "cuda", "quick": False,
        "environment": {"gpu_name": "NVIDIA H200", "capability": "9.0", "driver": "570.1", "cuda": "12.8",
                        "python": "3.12.0", "platform": "Linux", "torch": "2.11.0", "triton": "3.6.0",
                        "nsa_backend": "0.1.0", "native": {"flash_mla": "1.0.0", "deep_gemm": None},
                        "git_commit": "abc", "git_dirty": False},
        "limits": {"copy_gbps": 4000.0, "bf16_tflops": 750.0, "fp8_tflops": None},
        "limit_sizes": {"copy_bytes": 1 << 31, "matmul_n": 8192},
        "families": {"topk": {"status": "ok", "source": "module", "rows": 1, "seconds": 1.5, "note": None}},
        "rows": [_row("topk_indices", "triton", 0.2, shape={"R": 128}, gbps=10.0, ratios={"vs_torch": 2.0})],
    }


@pytest.mark.parametrize("path, value, message", [
    (("rows", 0, "ms"), -1.0, r"result.rows\[0\].ms: expected > 0"),
    (("rows", 0, "ratios", "vs_torch"), "2x", r"ratios.vs_torch: expected number or null"),
    (("rows", 0, "impl"), "", r"rows\[0\].impl: expected a string of length >= 1"),
    (("limits", "copy_gbps"), float("inf"), r"limits.copy_gbps: expected number or null"),
    (("families", "topk", "status"), "done", r"families.topk.status: expected one of"),
    (("device",), "tpu", r"result.device: expected one of"),
    (("quick",), 1, r"result.quick: expected boolean"),
    (("environment", "native", "flash_mla"), 1.0, r"native.flash_mla: expected string or null"),
], ids=["negative-ms", "ratio-str", "empty-impl", "inf-limit", "bad-status", "bad-device", "int-bool",
        "native-version"])
def test_schema_rejects(path, value, message):
    result = _valid_result()
    validate(result)
    target = result
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=message):
        validate(result)


def test_schema_required_and_extra_keys():
    result = _valid_result()
    for key in ("rows", "limits", "environment"):
        broken = copy.deepcopy(result)
        del broken[key]
        with pytest.raises(ValueError, match=f"missing required key '{key}'"):
            validate(broken)
    broken = copy.deepcopy(result)
    del broken["rows"][0]["ratios"]
    with pytest.raises(ValueError, match=r"rows\[0\]: missing required key 'ratios'"):
        validate(broken)
    broken = copy.deepcopy(result)
    broken["extra"] = 1
    with pytest.raises(ValueError, match="unexpected key 'extra'"):
        validate(broken)
    extra_row_key = copy.deepcopy(result)
    extra_row_key["rows"][0]["bytes"] = 123  # rows may carry more keys
    validate(extra_row_key)


# ----------------------------------------------------------------------------------------------
# Timing and plots
# ----------------------------------------------------------------------------------------------

def test_bench_ms_cpu():
    ms = bench_ms(lambda: time.sleep(0.002), warmup=1, rep=10, device="cpu")
    assert 1.5 < ms < 100
    calls = []
    assert bench_ms(lambda: calls.append(1), warmup=0, rep=0, device="cpu") >= 0
    assert len(calls) == 2  # warm call, then the estimate doubles as the one timed call
    calls.clear()
    bench_ms(lambda: calls.append(1), warmup=0, rep=1e9, device="cpu")
    assert len(calls) == 2 + 1000 - 1  # capped at MAX_CALLS timed calls
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert gbps(4e9, 2.0) == pytest.approx(2000.0)
    assert tflops(None, 1.0) is None and gbps(1.0, None) is None


@pytest.mark.parametrize("flush", ["zero", None, 1])
def test_bench_ms_rejects_unknown_flush(flush):
    with pytest.raises(ValueError, match="flush_l2"):
        bench_ms(lambda: None, warmup=0, rep=0, device="cpu", flush_l2=flush)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flush", [True, "read", "write", False])
def test_bench_ms_cuda_flush_modes(flush):
    x = torch.ones(1 << 20, device="cuda")
    assert bench_ms(lambda: x.mul_(1.0), warmup=1, rep=5, flush_l2=flush) > 0


def test_plots_skipped_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(RuntimeWarning, match="matplotlib is not installed"):
        assert write_plots(_valid_result(), tmp_path) == []
    assert not list(tmp_path.iterdir())


def test_read_kv_pages_reads_every_page_and_writes_the_logits():
    """The paged logits' reference reads: the xor of each program's cache words, and with ``logits`` zeros
    over exactly the pages' columns of every row (the op's output bytes)."""
    from nsa_backend.bench.indexer import READ_PAGES_PER_PROGRAM, read_kv_pages

    g = torch.Generator().manual_seed(0)
    P, page, D, B, n_pages = 11, 64, 128, 2, READ_PAGES_PER_PROGRAM + 1
    cache = torch.randint(0, 256, (P, page, 1, D + 4), dtype=torch.uint8, generator=g)
    table = torch.randperm(P, generator=g)[: B * n_pages].int().view(B, n_pages)
    words = cache.view(P, -1).view(torch.int32)

    def want_xor() -> list[int]:
        out = []
        for b in range(B):
            for p0 in range(0, n_pages, READ_PAGES_PER_PROGRAM):
                w = words[table[b, p0:p0 + READ_PAGES_PER_PROGRAM].long()].flatten()
                acc = 0
                for v in w.tolist():
                    acc ^= v
                out.append(acc)
        return out

    assert read_kv_pages(cache, table).tolist() == want_xor()
    logits = torch.full((B, 2, n_pages * page + 7), float("nan"))
    assert read_kv_pages(cache, table, logits).tolist() == want_xor()
    assert torch.equal(logits[..., : n_pages * page], torch.zeros(B, 2, n_pages * page))
    assert torch.isnan(logits[..., n_pages * page:]).all()
    with pytest.raises(ValueError, match="logits"):
        read_kv_pages(cache, table, torch.zeros(B, 2, n_pages * page - 1))
    with pytest.raises(ValueError, match="logits"):
        read_kv_pages(cache, table, torch.zeros(B, 2, n_pages * page, dtype=torch.float64))
