#!/usr/bin/env bash
# Cached virtual environment with a real vllm release (scripts/requirements/vllm-RELEASE.txt) and this
# repository installed in editable mode; prints its python (see scripts/venv.sh). RELEASE is 0.33 or
# 0.34 (default: the newest).
#   python=$(scripts/vllm-env.sh 0.33 | tail -n 1)
#   "$python" -m pytest tests/integrations -k vllm -q
exec "$(dirname "${BASH_SOURCE[0]}")/venv.sh" "vllm-${1:-0.34}"
