"""``nsa_backend.bench.kernel_time``: the per-call spans read from profiler activities, the ratios, the
table, the command line without a GPU, and (GPU) one profiled op."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_backend.bench import kernel_time as kt

MARK = kt.EVICT_KERNEL_NAME


def test_call_spans_from_first_start_to_last_end_of_each_call():
    events = [
        ("warmup_kernel", 0, 50),  # before the first marker: not a call
        (MARK, 100, 200),
        ("gemm", 210, 400),
        ("reduce", 390, 420),  # overlaps the previous kernel: the span ends at the later end
        (MARK + "_with_suffix", 500, 600),  # a mangled name that starts with the marker
        ("gemm", 650, 700),
        (MARK, 800, 900),  # the last marker: nothing after it
    ]
    spans = kt.call_spans(reversed(events))  # any order
    assert spans == pytest.approx([(420 - 210) / 1e6, (700 - 650) / 1e6])


def test_call_spans_counts_a_call_after_the_last_marker_and_skips_empty_ones():
    events = [(MARK, 0, 10), (MARK, 20, 30), ("k", 40, 45), ("k2", 60, 80)]
    assert kt.call_spans(events) == pytest.approx([40 / 1e6])
    assert kt.call_spans([("k", 0, 5)]) == []


def _rows():
    return [
        {"group": "limit", "shape": "2 GiB", "impl": "copy", "event_ms": 1.0, "kernel_ms": 0.8, "bytes": 4e9},
        {"group": "op", "shape": "s", "impl": "triton", "event_ms": 0.02, "kernel_ms": 0.0125, "bytes": 40e6},
        {"group": "dec", "shape": "s", "impl": "triton", "event_ms": 0.08, "kernel_ms": 0.075, "bytes": None},
        {"group": "dec", "shape": "s", "impl": "native", "event_ms": 0.12, "kernel_ms": 0.1, "bytes": None},
    ]


def test_add_ratios_against_the_copy_rate_timed_the_same_way_and_other_impls():
    rows = _rows()
    kt.add_ratios(rows)
    op = rows[1]
    assert op["of_copy_event"] == pytest.approx((40e6 / 0.02) / (4e9 / 1.0))
    assert op["of_copy_kernel"] == pytest.approx((40e6 / 0.0125) / (4e9 / 0.8))
    dec = rows[2]
    assert dec["vs_native_event"] == pytest.approx(0.12 / 0.08)
    assert dec["vs_native_kernel"] == pytest.approx(0.1 / 0.075)
    assert "of_copy_event" not in rows[0] and "vs_native_event" not in rows[3]


def test_markdown_has_every_row_and_both_times():
    rows = _rows()
    kt.add_ratios(rows)
    text = kt.to_markdown(rows)
    lines = [x for x in text.splitlines() if x.startswith("| ") and "---" not in x]
    assert len(lines) == 1 + len(rows)
    assert "| op | s | triton | 20.00 | 12.50 | of_copy 0.500 / 0.640 |" in text
    assert "vs_native 1.500 / 1.333" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without CUDA")
def test_command_line_without_cuda_measures_nothing(capsys):
    assert kt.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.gpu
def test_kernel_span_of_a_profiled_op_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(1 << 22, device="cuda")
    y = torch.empty_like(x)
    ms = kt.kernel_span_ms(lambda: torch.mul(x, 2.0, out=y), calls=8)
    assert math.isfinite(ms) and ms > 0
    torch.testing.assert_close(y, x * 2.0)
