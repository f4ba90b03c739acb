"""Ahead-of-time compile scripts run in a subprocess, shared by the AOT tests of every family.

The subprocess runs without ``TRITON_INTERPRET`` (set for the CPU tests), so Triton compiles for the
real targets, and from the repository root, so it imports this checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_aot_script(
    script: str, *args: str, timeout: int, marker: str = "", env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``python -c script *args`` and return the JSON rows it prints on its line starting with
    ``marker`` (no marker: its last line). ``env`` adds variables to the subprocess's environment."""
    run_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + run_env.get("PYTHONPATH", "")
    run_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    if marker:
        line = next(x for x in proc.stdout.splitlines() if x.startswith(marker))
        return json.loads(line[len(marker):])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_rows_fit(rows: list[Any], archs: set[int]) -> None:
    """Rows ``[kind, arch, config, shared bytes, limit]`` cover ``archs`` and every kernel fits its limit."""
    got = {r[1] for r in rows}
    assert got == archs, f"compiled for {sorted(got)}, expected {sorted(archs)}"
    for kind, arch, cfg, shared, limit in rows:
        assert shared <= limit, f"{kind} sm_{arch} {cfg}: {shared} B shared > {limit} B"
