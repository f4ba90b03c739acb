"""When Gluon kernels may launch: version, arch, interpreter and the NSA_BACKEND_GLUON switch."""

from __future__ import annotations

import pytest

from nsa_backend.kernels import _gluon


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3.6.0", (3, 6)), ("3.10.1", (3, 10)), ("3.4.0+git1a2b", (3, 4)), ("4.0", (4, 0)), ("3", (3, 0))],
)
def test_version_parsing(text, expected):
    assert _gluon._version(text) == expected


def test_gate(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("NSA_BACKEND_GLUON", raising=False)
    monkeypatch.setattr(_gluon, "gluon_importable", lambda: True)
    assert _gluon.gluon_enabled(90, (90,))
    assert not _gluon.gluon_enabled(120, (90,))
    assert not _gluon.gluon_enabled(None, (90,))
    monkeypatch.setenv("NSA_BACKEND_GLUON", "0")
    assert not _gluon.gluon_enabled(90, (90,))
    monkeypatch.setenv("NSA_BACKEND_GLUON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _gluon.gluon_enabled(90, (90,))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(_gluon, "gluon_importable", lambda: False)
    assert not _gluon.gluon_enabled(90, (90,))


def test_old_triton_is_refused(monkeypatch):
    _gluon.gluon_importable.cache_clear()
    monkeypatch.setattr(_gluon.triton, "__version__", "3.4.0")
    try:
        assert not _gluon.gluon_importable()
    finally:
        _gluon.gluon_importable.cache_clear()


def test_switch_rejects_unknown_value(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_gluon, "gluon_importable", lambda: True)
    monkeypatch.setenv("NSA_BACKEND_GLUON", "off")
    assert not _gluon.gluon_enabled(90, (90,))
    monkeypatch.setenv("NSA_BACKEND_GLUON", "maybe")
    with pytest.raises(ValueError, match="NSA_BACKEND_GLUON"):
        _gluon.gluon_enabled(90, (90,))
