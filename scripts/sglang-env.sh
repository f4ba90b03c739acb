#!/usr/bin/env bash
# Cached virtual environment with the real sglang release (scripts/requirements/sglang.txt) and this
# repository installed in editable mode; prints its python (see scripts/venv.sh).
#   python=$(scripts/sglang-env.sh | tail -n 1)
#   "$python" -m pytest tests/integrations -k sglang -q
exec "$(dirname "${BASH_SOURCE[0]}")/venv.sh" sglang
