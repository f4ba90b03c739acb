#!/usr/bin/env bash
# On a CUDA machine: the GPU tests, the same tests with routing forced to sm120 (the RTX 5090 /
# RTX PRO 6000 route: Triton kernels with sm_120 launch configurations), the demo layer on both
# routes, and the benchmark suite. Uses the current python; results go to OUT_DIR.
#   scripts/gpu-check.sh OUT_DIR [--no-bench]
set -uo pipefail
out="${1:?usage: scripts/gpu-check.sh OUT_DIR [--no-bench]}"
bench=1
[ "${2:-}" = "--no-bench" ] && bench=0
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'

echo "==== GPU tests (native route) ===="
python3 -m pytest tests -m gpu -q -p no:cacheprovider -x --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "==== GPU tests with routing forced to sm120 ===="
NSA_BACKEND_FORCE_ARCH=sm120 python3 -m pytest tests/ops tests/test_dsa_pipeline.py -m gpu -q -p no:cacheprovider \
    --junitxml="$out/gpu-tests-sm120.xml" 2>&1 | tee "$out/gpu-tests-sm120.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "==== demo ===="
python3 -m nsa_backend.cli demo --device cuda 2>&1 | tee "$out/demo.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
NSA_BACKEND_FORCE_ARCH=sm120 python3 -m nsa_backend.cli demo --device cuda 2>&1 | tee "$out/demo-sm120.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ "$bench" = 1 ]; then
    echo "==== benchmark suite ===="
    python3 -m nsa_backend.bench --out "$out/bench" --no-progress || status=1
fi
exit $status
