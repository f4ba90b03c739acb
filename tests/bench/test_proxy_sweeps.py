"""``bench/proxy_sweeps.py``'s command line: bad arguments end in one line naming the problem (exit 2)."""

from __future__ import annotations

import pytest
import torch

from nsa_backend.configs import mhc as cfgs
from nsa_backend.kernels.aot import SHARED_MEMORY_PER_SM
from tests.bench._scripts import load_script


@pytest.fixture(scope="module")
def sweeps():
    return load_script("proxy_sweeps")


@pytest.mark.parametrize("argv, says", [
    (["bogus", "--out", "x"], "argument sweeps: invalid choice: 'bogus'"),
    (["paged"], "the following arguments are required: --out"),
    (["splits", "--out", "x", "--splits-batches", "1,x"], "argument --splits-batches: expected comma-separated"),
    (["splits", "--out", "x", "--splits-topk", "0"], "argument --splits-topk: expected comma-separated"),
    (["splits", "--out", "x", "--splits-heads", ""], "argument --splits-heads: expected comma-separated"),
])
def test_bad_arguments(sweeps, capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        sweeps.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_refuses_without_a_gpu(sweeps, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sweeps.main(["paged", "v4", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_every_sweep_has_a_runner(sweeps):
    assert set(sweeps.SWEEPS) == {"paged", "v4", "decode", "prefill", "ragged", "mhc", "splits"}
    for name in sweeps.SWEEPS:
        assert callable(getattr(sweeps, f"sweep_{name}"))


def test_mhc_candidates_fit_an_sm120_sm(sweeps):
    # each stacked-parts candidate, times the programs per SM it is planned for, fits one sm_120 SM
    for tile, per_sm in sweeps.MHC_PARTS_TILES:
        need = per_sm * cfgs.GemmConfig(*tile).shared_bytes_estimate(32, True, cfgs.PARTS_PRECISION)
        assert need <= SHARED_MEMORY_PER_SM[120], (tile, per_sm, need)


def test_split_counts(sweeps):
    # the planners' range: at least MIN_KEYS_PER_SPLIT (256) keys a split, at most MAX_SPLITS
    assert sweeps.split_counts(2048, False) == list(range(1, 9))
    assert sweeps.split_counts(512, False) == [1, 2]
    # past it: down to one 32-key tile a split, each count as whole tiles give it (no empty split)
    assert sweeps.split_counts(2048, True) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 16, 22, 32, 64]
    assert sweeps.split_counts(512, True) == [1, 2, 3, 4, 6, 8, 16]


@pytest.mark.parametrize("kernels, h_q, want", [
    ("mma_v2", 32, [("fp8", "sparse_mla_decode_mma_v2"), ("bf16", "sparse_mla_decode_bf16_mma_v2")]),
    ("sm90", 16, [("fp8", "sparse_mla_decode_gluon")]),
    ("sm90", 64, [("fp8", "sparse_mla_decode_gluon_ws")]),
])
def test_split_kernels(sweeps, kernels, h_q, want):
    got = sweeps._split_kernels(kernels, h_q)
    assert [(cache, decode.__name__) for cache, _, decode in got] == want
    for _, plan, _ in got:  # the launcher's planned count, from shapes only
        assert plan(40, 1, h_q, 2048, 132) >= 1
