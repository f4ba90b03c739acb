#!/usr/bin/env bash
# Cached virtual environment with the real vllm release (scripts/requirements/vllm.txt) and this
# repository installed in editable mode; prints its python (see scripts/venv.sh).
#   python=$(scripts/vllm-env.sh | tail -n 1)
#   "$python" -m pytest tests/integrations -k vllm -q
exec "$(dirname "${BASH_SOURCE[0]}")/venv.sh" vllm
