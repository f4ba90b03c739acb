"""The ``sparse_mla`` benchmark family's decode rows on CPU (the interpreter): the hot-key tile rows."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.bench import sparse_mla as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case of the family")
def test_decode_rows_include_the_hot_key_tiles():
    rows = bench.bench_decode(1, 1, 16, 64, torch.device("cpu"), None, False)
    hot = {r["impl"]: r for r in rows if r["impl"].startswith("tile_hot")}
    assert sorted(hot) == ["tile_hot_bf16", "tile_hot_fp8"]
    for r in hot.values():
        assert r["ms"] and r["ms"] > 0 and not r["note"], r
        assert r["tflops"] and r["gbps"] is None  # useful FLOPs of the op; no DRAM bytes counted


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "bf16"])
def test_hot_key_inputs_cycle_over_one_page(kv_format):
    from nsa_backend.reference import sparse_mla_decode

    a = bench.decode_inputs(2, 2, 16, 150, torch.device("cpu"))
    hot = bench.hot_key_inputs(a, kv_format)
    idx = hot["indices"]
    assert idx.shape == a["indices"].shape and idx.dtype == torch.int32
    assert int(idx.min()) == 0 and int(idx.max()) == bench.HOT_SLOTS - 1 < bench.PAGE
    assert torch.equal(idx[1, 1, :bench.HOT_SLOTS], torch.arange(bench.HOT_SLOTS, dtype=torch.int32))
    # a valid call of the op: every key attended exists and the output is finite
    out, lse = sparse_mla_decode(hot["q"], hot["kv_cache"], idx, hot["sm_scale"], kv_format=kv_format)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
