#!/usr/bin/env bash
# The whole test suite, on a fresh machine or a warm one:
#   1. core environment (CPU torch, triton, pytest, ruff): ruff, then every test under tests/
#      (Triton kernels run in the CPU interpreter when there is no GPU; GPU tests skip);
#   2. the SGLang integration and routing tests inside an environment with the real sglang release
#      (routing is checked against SGLang's own validators and the native packages it brings);
#   3. the vLLM integration and routing tests inside an environment with each supported vllm release
#      (0.33.0 and 0.34.0);
#   4. the core tests again with the oldest supported torch and triton (torch 2.8, triton 3.4), less
#      the ahead-of-time compile checks (triton 3.4's ptxas predates sm_121), the benchmark harness
#      and the packaging tests (they need the tools of the core environment).
# Environments (requirements in scripts/requirements/) are cached under $NSA_BACKEND_CACHE (default
# ~/.cache/nsa-backend) and created when missing. Options: --core-only skips 2 to 4. Extra arguments
# after -- go to every pytest call.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

core_only=0
pytest_extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --core-only) core_only=1 ;;
        --) shift; pytest_extra=("$@"); break ;;
        *) echo "usage: scripts/test.sh [--core-only] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
    esac
    shift
done

reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0

stage() { printf '\n==== %s ====\n' "$*"; }

stage "core environment"
if ! core_py="$(scripts/venv.sh core | tail -n 1)"; then
    echo "could not create the core environment" >&2
    exit 1
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1

stage "ruff"
"$core_py" -m ruff check . || status=1

stage "core tests"
"$core_py" -m pytest tests -q -p no:cacheprovider --junitxml="$reports/core.xml" "${pytest_extra[@]}" || status=1

if [ "$core_only" = 0 ]; then
    stage "SGLang integration (sglang==0.5.23)"
    if sg_py="$(scripts/venv.sh sglang | tail -n 1)"; then
        # tests/routing again: there its checks against SGLang's own validators and the real native
        # packages' signatures run instead of skipping.
        "$sg_py" -m pytest tests/integrations/test_sglang_*.py tests/routing -q -p no:cacheprovider \
            --junitxml="$reports/sglang.xml" "${pytest_extra[@]}" || status=1
    else
        echo "could not create the SGLang environment" >&2; status=1
    fi

    # The two newest vLLM releases, one cached environment each (scripts/requirements/vllm-*.txt).
    for release in 0.33 0.34; do
        stage "vLLM integration (vllm==$release.0)"
        if vl_py="$(scripts/venv.sh "vllm-$release" | tail -n 1)"; then
            "$vl_py" -m pytest tests/integrations/test_vllm_*.py tests/routing -q -p no:cacheprovider \
                --junitxml="$reports/vllm-$release.xml" "${pytest_extra[@]}" || status=1
        else
            echo "could not create the vLLM $release environment" >&2; status=1
        fi
    done
fi

if [ "$core_only" = 0 ]; then
    stage "oldest supported versions (torch 2.8, triton 3.4)"
    if min_py="$(scripts/venv.sh min | tail -n 1)"; then
        "$min_py" -m pytest tests -q -p no:cacheprovider -k "not aot" --ignore=tests/bench \
            --ignore=tests/test_packaging.py --ignore=tests/test_release.py --junitxml="$reports/min-versions.xml" "${pytest_extra[@]}" || status=1
    else
        echo "could not create the minimum-versions environment" >&2; status=1
    fi
fi

stage "summary"
"$core_py" - "$reports" <<'PY'
import pathlib, sys
import xml.etree.ElementTree as ET
totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for xml in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        counts = {k: int(suite.get(k, 0)) for k in totals}
        for k in totals:
            totals[k] += counts[k]
        ran = counts["tests"] - counts["skipped"]
        print(f"{xml.stem:>12}: {ran - counts['failures'] - counts['errors']} passed, "
              f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped")
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - totals["skipped"] - failed
print(f"total: {passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
exit $status
