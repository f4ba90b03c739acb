"""The ``peers`` benchmark family without SGLang: clear skip notes, valid rows, no error.

Runs in the core environment (no sglang). ``importlib.util.find_spec`` is made to find no ``sglang`` so
the case holds wherever the suite runs; ``NSA_BACKEND_BENCH_SGLANG_ROOT`` pointing at a tree without
the peer files gives one note per missing file, and at a directory without ``sglang/`` a clear error.
"""

from __future__ import annotations

import importlib.util

import pytest

from nsa_backend.bench import peers
from nsa_backend.bench import peers_sglang as sg
from nsa_backend.bench.runner import _run_family, normalize_row


@pytest.fixture
def no_sglang(monkeypatch):
    monkeypatch.delenv(sg.SGLANG_ROOT_ENV, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))


def test_no_sglang_gives_one_skip_note_per_peer(no_sglang):
    assert sg.find_sglang_root() is None
    rows = [normalize_row(r, "peers") for r in peers.run(True, {})]
    peer_rows = [r for r in rows if (r["op"], r["impl"]) in sg.PEERS]
    assert sorted((r["op"], r["impl"]) for r in peer_rows) == sorted(sg.PEERS)
    for r in peer_rows:
        assert r["ms"] is None
        assert r["note"].startswith("skipped: no sglang package") and sg.SGLANG_ROOT_ENV in r["note"]
    # nothing of ours is timed without a peer to compare with
    assert all(r["impl"].startswith("sglang") for r in rows)


def test_runner_reports_the_family_ok_with_notes(no_sglang):
    rows, info = _run_family("peers", "nsa_backend.bench.peers", True, {}, None)
    assert info["status"] == "ok", info
    assert rows and all(r["ms"] is None and r["note"] for r in rows)


def test_tree_without_the_peer_files_names_each_missing_file(tmp_path, monkeypatch):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    monkeypatch.setenv(sg.SGLANG_ROOT_ENV, str(tmp_path))
    tree = sg.find_sglang_root()
    assert tree is not None and tree.root == tmp_path.resolve() and tree.version is None
    with pytest.raises(sg.PeerUnavailable, match=r"flash_mla_sm120_triton\.py is not in"):
        sg.v4_decode_triton(tree)
    with pytest.raises(sg.PeerUnavailable, match=r"dsv4/indexer\.py is not in"):
        sg.paged_logits(tree, "sglang_torch")


def test_root_without_sglang_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(sg.SGLANG_ROOT_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=f"{sg.SGLANG_ROOT_ENV}: expected a directory containing the sglang/"):
        sg.find_sglang_root()
