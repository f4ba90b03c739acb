#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go).
# `run.sh tests`: the GPU tests; `run.sh sweep`: the timings; `run.sh all`: the tests, the timings, then the
# Nsight Compute profiles of profile.sh (PROFILE=0: not run). HEAD_KERNEL=<an earlier sm89_gluon.py>: timed beside
# under sm_120 (sweep.py); PV_SPLIT=<a sm80_gluon.py>: its prefill timed against the tree's and fuzzed (pv_split.py).
set -u
OUT=${OUT:-.}
D=bench/results/h100-proxy-sm120/fp8-mma-v2-one-layout
P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120"
export PYTHONPATH=$PWD
mkdir -p "$OUT/gpu-tests"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
MODE=${1:-tests}
F=tests/ops/test_sparse_mla_decode_mma_v2.py
if [ "$MODE" != sweep ]; then
  # (four processes at once: the compiles run in parallel)
  # the fp8 kernel's GPU tests under the proxy: its fuzz with the fp8 units, with sm_86's integer decoding, the rest
  T="timeout ${TESTS_S:-380} env $P python -m pytest -q -m gpu -p no:cacheprovider -rA -s"
  $T "$F::test_decode_mma_v2_gpu_fuzz[None]" > "$OUT/gpu-tests/fuzz_native.txt" 2>&1 &
  $T "$F::test_decode_mma_v2_gpu_fuzz[sm86]" > "$OUT/gpu-tests/fuzz_sm86.txt" 2>&1 &
  $T "$F" -k "not gpu_fuzz" > "$OUT/gpu-tests/fp8_others.txt" 2>&1 &
  # the routes of the other mma.sync kernels, their replays, and the profile script (OTHERS=0: not run)
  [ "${OTHERS:-1}" = 0 ] || timeout ${TESTS_S:-380} env DISABLE_MMA_V3=1 python -m pytest -q -m gpu tests/ops/test_sparse_mla_decode_bf16_mma_v2.py \
    tests/ops/test_sparse_mla_prefill_mma_v2.py tests/ops/test_replay.py tests/bench/test_profile_call.py \
    -k "route or mma_v2_decode_replay or mma_v2_paged or profile" -p no:cacheprovider -rA \
    > "$OUT/gpu-tests/routes_replay_profile.txt" 2>&1 &
  wait
fi
if [ "$MODE" != tests ]; then
  timeout ${SWEEP_S:-300} env DISABLE_MMA_V3=1 OUT=$OUT HEAD_KERNEL=${HEAD_KERNEL:-} python $D/sweep.py
fi
if [ -n "${PV_SPLIT:-}" ]; then
  timeout ${PV_S:-120} env DISABLE_MMA_V3=1 OUT=/tmp PV_SPLIT=$PV_SPLIT python $D/pv_split.py > "$OUT/pv_split.txt" 2>&1
fi
if [ "$MODE" = all ] && [ "${PROFILE:-1}" = 1 ]; then
  timeout ${PROFILE_S:-200} env OUT=$OUT bash $D/profile.sh
fi
