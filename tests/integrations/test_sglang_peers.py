"""SGLang's SM120 fallbacks as benchmark peers, loaded from the installed sglang 0.5.23 package.

The peers (:mod:`nsa_backend.bench.peers_sglang`) are loaded from the package files without importing
``sglang``, fed our inputs through the adapters, and compared with :mod:`nsa_backend.reference` on tiny
shapes. SGLang's Triton V4 decode runs in Triton's interpreter here (``TRITON_INTERPRET=1`` from
conftest; the adapter keeps its autotuner's first config, since the interpreter has no driver to
benchmark configs with); the torch fallbacks run as they are. ``run(quick=True)`` gives valid rows
where every peer matched ours and was timed.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("sglang")

from nsa_backend import reference as ref
from nsa_backend.bench import peers
from nsa_backend.bench import peers_sglang as sg
from nsa_backend.bench.runner import OURS_IMPLS, compute_ratios, normalize_row
from nsa_backend.bench.schema import validate_row

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tree() -> sg.SglangTree:
    t = sg.find_sglang_root()
    assert t is not None
    return t


def test_installed_sglang_is_found_without_importing_it(tree, monkeypatch):
    monkeypatch.delenv(sg.SGLANG_ROOT_ENV, raising=False)
    assert tree.version == "0.5.23"
    assert (tree.package / sg.DECODE_TRITON_FILE).is_file()
    monkeypatch.setenv(sg.SGLANG_ROOT_ENV, str(tree.root))
    assert sg.find_sglang_root().root == tree.root


def test_files_with_sglang_imports_are_not_loaded_whole(tree):
    with pytest.raises(sg.PeerUnavailable, match=r"imports \['sglang'\] at module level"):
        sg.load_file_module(tree, sg.DECODE_TORCH_FILE)
    # DSA's chunking wrapper reads SGLang's memory-budget helpers: refused, naming them
    with pytest.raises(sg.PeerUnavailable, match="mqa_logits_needs_budget_check"):
        sg.load_functions(tree, sg.INDEXER_DSA_FILE, ("_fp8_paged_mqa_logits_torch",))


def _v4_case():
    """Tiny V4 decode inputs with -1 slots and truncated lists (both caches)."""
    a = peers.v4_decode_inputs(2, 16, 256, 8, 16, CPU, swa_page=64, extra_page=64)
    a["indices"][0, 0, 3] = -1
    a["extra_indices"][1, 0, :2] = -1
    a["topk_length"][1] = 5
    a["extra_topk_length"][0] = 11
    return a


@pytest.mark.parametrize("impl", ["sglang_sm120_triton", "sglang_sm120_torch"])
def test_v4_decode_peer_matches_reference(tree, impl):
    a = _v4_case()
    fn = {"sglang_sm120_triton": sg.v4_decode_triton, "sglang_sm120_torch": sg.v4_decode_torch}[impl](tree)
    got = fn(a["q"], a["kv_cache"], a["indices"], a["topk_length"], a["extra_kv_cache"], a["extra_indices"],
             a["extra_topk_length"], a["sm_scale"])
    want = ref.sparse_mla_decode(a["q"], a["kv_cache"], a["indices"], a["sm_scale"], 512, "fp8_ds_mla_v4", None,
                                 a["topk_length"], extra_kv_cache=a["extra_kv_cache"],
                                 extra_indices=a["extra_indices"], extra_topk_length=a["extra_topk_length"])
    check = peers.compare_decode(got, (want[0].to(torch.bfloat16), want[1]))
    assert check["match"], check
    assert check["max_err"] < 0.05


def test_v4_decode_adapter_rejects_multi_token_queries(tree):
    a = _v4_case()
    fn = sg.v4_decode_triton(tree)
    with pytest.raises(ValueError, match=r"q: expected bfloat16 \[B, 1, h_q, 512\]"):
        fn(a["q"].expand(-1, 2, -1, -1), a["kv_cache"], a["indices"], a["topk_length"], a["extra_kv_cache"],
           a["extra_indices"], a["extra_topk_length"], a["sm_scale"])


@pytest.mark.parametrize("impl", ["sglang_torch_sm120", "sglang_torch"])
def test_paged_logits_peer_matches_reference(tree, impl):
    a = peers.paged_inputs(3, 192, 1, 16, 128, CPU)
    a["context_lens"][1] = 70  # a partial second page
    fn = sg.paged_logits(tree, impl)
    got = fn(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], a["max_context_len"])
    want = ref.fp8_paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                                    None, a["max_context_len"])
    valid = torch.arange(192)[None, :] < a["context_lens"][:, None]
    check = peers.compare_logits(got, want, valid)
    assert check["match"], check


def test_ragged_logits_peer_matches_reference(tree):
    a = peers.ragged_inputs(5, 40, 16, 128, CPU)
    got = sg.ragged_logits(tree)(a["q"], a["kv"], a["weights"], a["ks"], a["ke"])
    want = ref.fp8_mqa_logits(a["q"], a["kv"], a["weights"], a["ks"], a["ke"])
    cols = torch.arange(40)[None, :]
    valid = (cols >= a["ks"][:, None]) & (cols < a["ke"][:, None])
    check = peers.compare_logits(got, want, valid)
    assert check["match"], check


def test_a_wrong_peer_output_is_not_timed():
    want = (torch.ones(1, 1, 2, 512, dtype=torch.bfloat16), torch.zeros(1, 2, 1))
    bad = (want[0] * 1.1, want[1])
    calls = []

    def run_peer():
        calls.append(1)
        return bad

    row = peers._peer_row("sparse_mla_decode", {}, "sglang_x", "src", run_peer,
                          lambda got: peers.compare_decode(got, want), False, None, None)
    assert row["ms"] is None and row["match"] is False and "differs from ours" in row["note"]
    assert math.isclose(row["max_err"], 0.1015625) and len(calls) == 1
    # NaN in the peer only is a mismatch, not a pass
    nan = (want[0].clone(), want[1])
    nan[0][0, 0, 0, 0] = float("nan")
    assert peers.compare_decode(nan, want)["match"] is False


def test_run_quick_rows_are_valid_and_every_peer_matched(tree):
    rows = [normalize_row(r, "peers") for r in peers.run(True, {})]
    for r in rows:
        validate_row(r)
    timed = {(r["op"], r["impl"]) for r in rows if r["ms"] is not None}
    for op, impl in sg.PEERS:
        peer = [r for r in rows if r["op"] == op and r["impl"] == impl and r.get("match") is not None]
        assert peer, f"no compared row for {op} / {impl}"
        assert all(r["match"] and r["ms"] and r["max_err"] <= 0.1 for r in peer), peer
        assert (op, "triton") in timed
    # next_n = 2 has no peer: note rows; the 656-byte decode has its note row
    assert any(r["shape"].get("next_n") == 2 and r["ms"] is None and "next_n = 1" in r["note"] for r in rows)
    assert any(r["impl"] == "sglang_sm120" and "FlashInfer" in r["note"] for r in rows)
    ours = [r for r in compute_ratios(rows, {}) if r["impl"] in OURS_IMPLS]
    assert all(any(k.startswith("vs_sglang") for k in r["ratios"]) for r in ours)
