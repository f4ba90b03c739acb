#!/usr/bin/env bash
# Create (or reuse) the cached virtual environment in which the vLLM integration is tested against
# the real vLLM release, install this repository into it in editable mode, and print its python.
#
#   python=$(scripts/vllm-env.sh)          # the last line of stdout is the interpreter path
#   "$python" -m pytest tests/integrations/test_vllm_*.py -q
#
# Environment:
#   NSA_BACKEND_CACHE   cache root (default: $HOME/.cache/nsa-backend)
#   NSA_VLLM_VENV       environment directory (default: $NSA_BACKEND_CACHE/venv-vllm)
#   NSA_VLLM_PYTHON     interpreter that creates the environment (default: python3)
#
# The requirement set is installed once; a stamp file keyed by the requirements and the interpreter
# version makes later calls skip pip entirely (it is the stamp `scripts/venv.sh vllm` writes, so either
# script reuses the other's install). The editable install is redone only when the
# repository path or pyproject.toml changes. A lock file serialises concurrent calls. Installer
# output goes to stderr, so stdout carries only the interpreter path.
set -euo pipefail

VLLM_REQUIREMENTS=("vllm==0.33.0" "pytest")

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${NSA_BACKEND_CACHE:-$HOME/.cache/nsa-backend}"
venv="${NSA_VLLM_VENV:-$cache/venv-vllm}"
base_python="${NSA_VLLM_PYTHON:-python3}"
py="$venv/bin/python"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

key() { sha256sum | cut -c1-20; }

if [ ! -x "$py" ]; then
    echo "vllm-env: creating $venv" >&2
    "$base_python" -m venv "$venv" >&2
fi

requirements_key="$(
    {
        printf '%s\n' "${VLLM_REQUIREMENTS[@]}"
        "$py" -c 'import sys; print(sys.version)'
    } | key
)"
requirements_stamp="$venv/.nsa-backend-requirements"  # shared with scripts/venv.sh vllm
if [ "$(cat "$requirements_stamp" 2>/dev/null || true)" != "$requirements_key" ]; then
    echo "vllm-env: installing ${VLLM_REQUIREMENTS[*]} into $venv (the first run takes minutes)" >&2
    "$py" -m pip install -q --disable-pip-version-check "${VLLM_REQUIREMENTS[@]}" >&2
    echo "$requirements_key" >"$requirements_stamp"
fi

editable_key="$(
    {
        echo "$repo"
        cat "$repo/pyproject.toml"
        echo "$requirements_key"
    } | key
)"
editable_stamp="$venv/.nsa-backend-vllm-editable"
if [ "$(cat "$editable_stamp" 2>/dev/null || true)" != "$editable_key" ]; then
    echo "vllm-env: installing $repo in editable mode (no dependencies)" >&2
    # setuptools arrives with vLLM's dependencies; use an isolated build only if it is missing.
    if ! "$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
        -e "$repo" >&2; then
        "$py" -m pip install -q --disable-pip-version-check --no-deps -e "$repo" >&2
    fi
    echo "$editable_key" >"$editable_stamp"
fi

echo "$py"
