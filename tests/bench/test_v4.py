"""The ``v4`` benchmark family on CPU: one row per op through the reference, each bounded by its limit."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.bench import runner, v4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case of the family")
def test_v4_family_rows_on_cpu():
    rows = [runner.normalize_row(r, "v4") for r in v4.run(True, {})]
    assert [(r["op"], r["impl"]) for r in rows] == [
        ("fp8_fp4_paged_mqa_logits", "reference"), ("fp8_fp4_mqa_logits", "reference"),
        ("write_fp8_ds_mla_v4_cache", "reference")]
    assert all(r["ms"] and r["ms"] > 0 and not r.get("note") for r in rows), rows
    assert rows[0]["gbps"] and rows[0]["tflops"] and rows[1]["tflops"] and rows[2]["gbps"]
    assert [r["limit"] for r in rows] == [["copy_gbps", "fp8_tflops"], ["fp8_tflops"], ["copy_gbps"]]
    # the paged logits are bound by both limits: the runner adds their roofline share
    ratios = runner.compute_ratios(rows, {"copy_gbps": 1.0, "bf16_tflops": None, "fp8_tflops": 1.0})[0]["ratios"]
    assert ratios["of_roofline"] == max(ratios["of_copy"], ratios["of_fp8_mm"])


def test_v4_ops_select_the_v4_family():
    for op in ("fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits", "write_fp8_ds_mla_v4_cache"):
        assert runner.select([op]) == (["v4"], {"v4": {op}})


def test_write_inputs_are_a_valid_call():
    a = v4.write_inputs(8, torch.device("cpu"))
    assert a["slots"].unique().numel() == 8 and int(a["pos"].max()) < a["cs"].shape[0]
