#!/usr/bin/env bash
# Create (or reuse) the cached virtual environment used to test the SGLang integration against the
# real SGLang release, install this repository into it in editable mode, and print its python.
#
#   python=$(scripts/sglang-env.sh)        # the last line of stdout is the interpreter path
#   "$python" -m pytest tests/integrations -q
#
# Environment:
#   NSA_BACKEND_CACHE   cache root (default: $HOME/.cache/nsa-backend)
#   NSA_SGLANG_VENV     environment directory (default: $NSA_BACKEND_CACHE/venv-sglang)
#   NSA_SGLANG_PYTHON   interpreter used to create the environment (default: python3)
#
# A stamp file keyed by the requirement set and the interpreter version makes a second call a no-op
# for the packages; the editable install is refreshed only when the repository path or pyproject.toml
# changes. A lock serialises concurrent calls. Installer output goes to stderr.
set -euo pipefail

SGLANG_REQUIREMENTS=("sglang==0.5.23" "pytest")

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${NSA_BACKEND_CACHE:-$HOME/.cache/nsa-backend}"
venv="${NSA_SGLANG_VENV:-$cache/venv-sglang}"
base_python="${NSA_SGLANG_PYTHON:-python3}"
py="$venv/bin/python"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

digest() { sha256sum | cut -c1-20; }

if [ ! -x "$py" ]; then
    echo "sglang-env: creating $venv" >&2
    "$base_python" -m venv "$venv" >&2
fi

req_key="$(printf '%s\n' "${SGLANG_REQUIREMENTS[@]}" "$("$py" -c 'import sys; print(sys.version)')" | digest)"
req_stamp="$venv/.nsa-backend-requirements"
if [ "$(cat "$req_stamp" 2>/dev/null || true)" != "$req_key" ]; then
    echo "sglang-env: installing ${SGLANG_REQUIREMENTS[*]} (first run can take several minutes)" >&2
    "$py" -m pip install -q --disable-pip-version-check "${SGLANG_REQUIREMENTS[@]}" >&2
    echo "$req_key" >"$req_stamp"
fi

dev_key="$(
    {
        echo "$repo"
        cat "$repo/pyproject.toml" 2>/dev/null || true
        echo "$req_key"
    } | digest
)"
dev_stamp="$venv/.nsa-backend-editable"
if [ "$(cat "$dev_stamp" 2>/dev/null || true)" != "$dev_key" ]; then
    echo "sglang-env: installing $repo in editable mode" >&2
    # The build backend is normally already present (setuptools comes with SGLang's dependencies);
    # fall back to an isolated build when it is not.
    pip_q=("$py" -m pip install -q --disable-pip-version-check --no-deps)
    if ! "${pip_q[@]}" --no-build-isolation -e "$repo" >&2; then
        "${pip_q[@]}" -e "$repo" >&2
    fi
    echo "$dev_key" >"$dev_stamp"
fi

echo "$py"
