#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go). Each candidate
# (CANDS, folders under CAND_ROOT, each with sparse_mla_prefill/sm80_gluon.py and sparse_mla_decode/sm89_gluon.py)
# allocates the mma.sync tile's score exchange another way.
# `run.sh ab`: each candidate timed against the tree (ab.py, alone on the GPU);
# `run.sh all`: `ab`, then `check` without profiles for the candidate with the best mean speedup;
# `run.sh check`: each candidate's GPU fuzzes in a copy of the tree with the candidate in place, then Nsight Compute
# of the three kernels at 128 heads for the tree and for each candidate (PROFILE=0: not run).
set -u
OUT=${OUT:-.}
D=bench/results/h100-proxy-sm120/score-exchange
CANDS=${CANDS:-swizzle padded}
CAND_ROOT=${CAND_ROOT:-cand}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
export PYTHONPATH=$PWD
MODE=${1:-ab}
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  python -c "import triton; print('triton', triton.__version__)"
  python -c "from triton.experimental.gluon.language.nvidia.ampere import mbarrier; print('ampere mbarrier:', [n for n in dir(mbarrier) if not n.startswith('_')])" 2>&1 | tail -1
} > "$OUT/env_$MODE.txt"

tree_with() {  # a copy of the tree with candidate $1 in place
  local t=/tmp/tree_$1
  rm -rf "$t" && mkdir -p "$t" && cp -r nsa_backend nsa_backend_cli integrations tests bench pyproject.toml "$t"/
  cp "$CAND_ROOT/$1/sparse_mla_prefill/sm80_gluon.py" "$t/nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py"
  cp "$CAND_ROOT/$1/sparse_mla_decode/sm89_gluon.py" "$t/nsa_backend/kernels/sparse_mla_decode/sm89_gluon.py"
  echo "$t"
}

if [ "$MODE" = ab ] || [ "$MODE" = all ]; then
  for c in $CANDS; do
    timeout "${AB_S:-240}" env DISABLE_MMA_V3=1 OUT="$OUT" CAND="$CAND_ROOT/$c" python $D/ab.py >> "$OUT/ab.log" 2>&1 \
      || echo "ab $c: rc=$?" >> "$OUT/ab.log"
  done
fi

if [ "$MODE" = all ]; then
  CANDS=$(python - "$OUT/ab.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by: dict = {}
cand = None
for r in rows:
    if "cand" in r:
        cand = r["cand"]
    elif "speedup" in r:
        by.setdefault(cand, []).append(math.log(r["speedup"]))
print(max(by, key=lambda c: sum(by[c]) / len(by[c])) if by else "")
PY
)
  echo "best: $CANDS" >> "$OUT/ab.log"
  PROFILE=0
fi

if [ "$MODE" = check ] || [ "$MODE" = all ]; then
  P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120"
  for c in $CANDS; do
    t=$(tree_with "$c")
    # four processes per candidate (the compiles run in parallel); logs in /tmp, gathered per candidate
    T="timeout ${TESTS_S:-300} env $P PYTHONPATH=$t python -m pytest -q -m gpu -p no:cacheprovider -rfE -s"
    (cd "$t" && $T tests/ops/test_sparse_mla_prefill_mma_v2.py -k "fuzz or empty or graph or rising" > /tmp/fz_${c}_prefill.txt 2>&1) &
    (cd "$t" && $T tests/ops/test_sparse_mla_decode_bf16_mma_v2.py -k "fuzz or graph or empty" > /tmp/fz_${c}_bf16.txt 2>&1) &
    (cd "$t" && $T "tests/ops/test_sparse_mla_decode_mma_v2.py::test_decode_mma_v2_gpu_fuzz[None]" > /tmp/fz_${c}_fp8.txt 2>&1) &
    (cd "$t" && $T "tests/ops/test_sparse_mla_decode_mma_v2.py::test_decode_mma_v2_gpu_fuzz[sm86]" > /tmp/fz_${c}_fp8_sm86.txt 2>&1) &
  done
  for c in ${BROKEN:-}; do  # a candidate broken on purpose: the test that must catch it
    t=$(tree_with "$c")
    (cd "$t" && timeout ${TESTS_S:-300} env $P PYTHONPATH=$t python -m pytest -q -m gpu -p no:cacheprovider -rfE \
      tests/ops/test_sparse_mla_prefill_mma_v2.py -k rising > /tmp/fz_${c}_rising.txt 2>&1) &
  done
  wait
  for c in ${BROKEN:-}; do echo "==== $c (broken on purpose) rising"; tail -15 /tmp/fz_${c}_rising.txt; done >> "$OUT/fuzz.txt"
  for c in $CANDS; do
    for k in prefill bf16 fp8 fp8_sm86; do echo "==== $c $k"; tail -15 /tmp/fz_${c}_$k.txt; done >> "$OUT/fuzz.txt"
  done
  if [ "${PROFILE:-1}" = 1 ]; then
    for c in tree $CANDS; do
      if [ "$c" = tree ]; then t=$PWD; else t=/tmp/tree_$c; fi
      for spec in "decode --h-q 128" "decode --h-q 128 --kv bf16" "prefill --h-q 128"; do
        name=${c}_$(echo "$spec" | tr -d '-' | tr ' ' '_')
        echo "==== $c $spec" >> "$OUT/ncu.txt"
        (cd "$t" && export PYTHONPATH="$t" && timeout "${NCU_S:-60}" "$NCU" --profile-from-start off --section SpeedOfLight --section SchedulerStats \
          --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section LaunchStats -f -o "/tmp/$name" \
          python bench/profile_call.py $spec --proxy sm120 > "/tmp/$name.log" 2>&1) \
          || tail -5 "/tmp/$name.log" >> "$OUT/ncu.txt"
        "$NCU" --import "/tmp/$name.ncu-rep" --page details >> "$OUT/ncu.txt" 2>&1
      done
    done
  fi
fi
