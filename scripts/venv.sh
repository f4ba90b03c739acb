#!/usr/bin/env bash
# Create (or reuse) a cached virtual environment, install a requirement set into it, install this
# repository in editable mode, and print the environment's python (last line of stdout).
#
#   python=$(scripts/venv.sh NAME [REQUIREMENT...])
#   python=$(scripts/venv.sh core)      # requirements from scripts/requirements/core.txt
#
# Environment:
#   NSA_BACKEND_CACHE   cache root (default: $HOME/.cache/nsa-backend); the venv is $NSA_BACKEND_CACHE/venv-NAME
#   NSA_BACKEND_PYTHON  interpreter used to create environments (default: python3)
#
# A stamp keyed by the requirement set and the interpreter version makes a second call skip pip; the
# editable install is refreshed when the repository path or its packaging files change. A lock
# serialises concurrent calls. Installer output goes to stderr.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="$1"
shift
if [ $# -gt 0 ]; then
    requirements=("$@")
else
    mapfile -t requirements < <(grep -v '^\s*\(#\|$\)' "$repo/scripts/requirements/$name.txt")
fi
# NAME.nodeps.txt, when present, lists packages installed afterwards with --no-deps: a release whose
# exact pins the package index cannot satisfy gets its requirements (with the stand-ins) from
# NAME.txt and itself from here.
nodeps=()
if [ $# -eq 0 ] && [ -f "$repo/scripts/requirements/$name.nodeps.txt" ]; then
    mapfile -t nodeps < <(grep -v '^\s*\(#\|$\)' "$repo/scripts/requirements/$name.nodeps.txt")
fi

cache="${NSA_BACKEND_CACHE:-$HOME/.cache/nsa-backend}"
venv="$cache/venv-$name"
py="$venv/bin/python"

mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9

digest() { sha256sum | cut -c1-20; }

if [ ! -x "$py" ]; then
    echo "venv[$name]: creating $venv" >&2
    "${NSA_BACKEND_PYTHON:-python3}" -m venv "$venv" >&2
fi

req_key="$(printf '%s\n' "${requirements[@]}" "nodeps:" "${nodeps[@]}" "$("$py" -c 'import sys; print(sys.version)')" | digest)"
req_stamp="$venv/.nsa-backend-requirements"
if [ "$(cat "$req_stamp" 2>/dev/null || true)" != "$req_key" ]; then
    echo "venv[$name]: installing ${requirements[*]} (a first run takes minutes)" >&2
    "$py" -m pip install -q --disable-pip-version-check "${requirements[@]}" >&2
    if [ ${#nodeps[@]} -gt 0 ]; then
        "$py" -m pip install -q --disable-pip-version-check --no-deps "${nodeps[@]}" >&2
    fi
    echo "$req_key" >"$req_stamp"
fi

dev_key="$(cat "$repo/pyproject.toml" "$repo/setup.py" <(echo "$repo" "$req_key") | digest)"
dev_stamp="$venv/.nsa-backend-editable"
if [ "$(cat "$dev_stamp" 2>/dev/null || true)" != "$dev_key" ]; then
    echo "venv[$name]: installing $repo in editable mode" >&2
    if ! "$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$repo" >&2; then
        "$py" -m pip install -q --disable-pip-version-check --no-deps -e "$repo" >&2
    fi
    echo "$dev_key" >"$dev_stamp"
fi

echo "$py"
