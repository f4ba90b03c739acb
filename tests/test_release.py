"""The release artifacts: ``python -m build`` makes an sdist and a wheel whose metadata a package
index accepts (what ``twine check`` reads), with the CLI, the plugins and the data files inside.

``.github/workflows/release.yml`` builds both from a fresh checkout plus ``twine check --strict``; here
the wheel is built from the sdist (a developer's checkout may hold a stale ``build/``) and the
metadata is read with the standard library so the check needs no extra package.
"""

from __future__ import annotations

import email.parser
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist. So the wheel holds
    # only what the sdist ships, and a stale build/lib of the checkout (setuptools packs everything in
    # it) cannot put a package into the wheel that setup.py no longer lists.
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return wheels[0], sdists[0]


def _check_metadata(text: str) -> None:
    meta = email.parser.Parser().parsestr(text)
    assert meta["Name"] == PROJECT["name"] and meta["Version"] == PROJECT["version"]
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Summary"] and "\n" not in meta["Summary"]
    # the long description is the README, rendered as Markdown on the index
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().lstrip().startswith("# nsa-backend")
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("torch>=2.8") for r in requires), requires


def test_wheel_contents_and_metadata(dist):
    wheel, _ = dist
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        _check_metadata(zf.read(info).decode())
        entry_points = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    # the console script is the launcher package, which builds the parser without importing torch
    assert "nsa-backend = nsa_backend_cli:main" in entry_points
    assert "nsa_backend_integrations.sglang.plugin:register" in entry_points
    for path in ("nsa_backend_cli/__init__.py", "nsa_backend_cli/errors.py", "nsa_backend_cli/bench.py",
                 "nsa_backend/cli.py", "nsa_backend/_cli_errors.py", "nsa_backend/_cli_commands.py",
                 "nsa_backend/_cli_demo.py", "nsa_backend/models/glm-5.json", "nsa_backend/py.typed",
                 "nsa_backend_integrations/sglang/settings.py", "nsa_backend_integrations/vllm/config.py"):
        assert path in names, path
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"nsa_backend", "nsa_backend_cli", "nsa_backend_integrations"}, top


def test_sdist_builds_the_same_package(dist):
    _, sdist = dist
    with tarfile.open(sdist) as tf:
        names = set(tf.getnames())
        root = sdist.name[: -len(".tar.gz")]
        _check_metadata(tf.extractfile(f"{root}/PKG-INFO").read().decode())
    for path in ("pyproject.toml", "setup.py", "README.md", "nsa_backend/cli.py", "nsa_backend_cli/__init__.py",
                 "integrations/vllm/plugin.py"):
        assert f"{root}/{path}" in names, path


def test_release_workflow_builds_and_checks():
    text = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert "python -m build --sdist --wheel" in text and "twine check --strict" in text
