#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go). Each candidate
# (CANDS, folders under CAND_ROOT, each with sparse_mla_prefill/sm80_gluon.py and sparse_mla_decode/sm89_gluon.py)
# places the mma.sync kernels' shared-memory buffers so that Triton's barrier analysis inserts fewer CTA barriers.
# `run.sh ab`: each candidate timed against the tree, alone on the GPU (the score-exchange folder's ab.py, which
#   takes any candidate folder);
# `run.sh check`: each candidate's GPU tests in a copy of the tree with the candidate in place;
# `run.sh ncu`: Nsight Compute (scheduler and warp-state statistics) of the prefill and the fp8 decode at 128 heads
#   for the tree and each candidate.
set -u
OUT=${OUT:-.}
CANDS=${CANDS:-split unroll}
CAND_ROOT=${CAND_ROOT:-cand}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
export PYTHONPATH=$PWD
MODE=${1:-ab}
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  python -c "import triton; print('triton', triton.__version__)"; } > "$OUT/env_$MODE.txt"

tree_with() {  # a copy of the tree with candidate $1 in place
  local t=/tmp/tree_$1
  rm -rf "$t" && mkdir -p "$t" && cp -r nsa_backend nsa_backend_cli integrations tests bench pyproject.toml "$t"/
  cp "$CAND_ROOT/$1/sparse_mla_prefill/sm80_gluon.py" "$t/nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py"
  cp "$CAND_ROOT/$1/sparse_mla_decode/sm89_gluon.py" "$t/nsa_backend/kernels/sparse_mla_decode/sm89_gluon.py"
  echo "$t"
}

if [ "$MODE" = ab ]; then
  for c in $CANDS; do
    timeout "${AB_S:-240}" env DISABLE_MMA_V3=1 OUT="$OUT" CAND="$CAND_ROOT/$c" \
      python bench/results/h100-proxy-sm120/score-exchange/ab.py >> "$OUT/ab.log" 2>&1 || echo "ab $c: rc=$?" >> "$OUT/ab.log"
  done
fi

if [ "$MODE" = check ]; then
  P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120"
  for c in $CANDS; do
    t=$(tree_with "$c")
    T="timeout ${TESTS_S:-300} env $P PYTHONPATH=$t python -m pytest -q -m gpu -p no:cacheprovider -rfE"
    (cd "$t" && $T tests/ops/test_sparse_mla_prefill_mma_v2.py > /tmp/fz_${c}_prefill.txt 2>&1) &
    (cd "$t" && $T tests/ops/test_sparse_mla_decode_bf16_mma_v2.py > /tmp/fz_${c}_bf16.txt 2>&1) &
    (cd "$t" && $T tests/ops/test_sparse_mla_decode_mma_v2.py -k "not fuzz" > /tmp/fz_${c}_fp8_others.txt 2>&1) &
    (cd "$t" && $T "tests/ops/test_sparse_mla_decode_mma_v2.py::test_decode_mma_v2_gpu_fuzz[None]" > /tmp/fz_${c}_fp8.txt 2>&1) &
    (cd "$t" && $T "tests/ops/test_sparse_mla_decode_mma_v2.py::test_decode_mma_v2_gpu_fuzz[sm86]" > /tmp/fz_${c}_fp8_sm86.txt 2>&1) &
  done
  wait
  for c in $CANDS; do
    for k in prefill bf16 fp8_others fp8 fp8_sm86; do echo "==== $c $k"; tail -8 /tmp/fz_${c}_$k.txt; done >> "$OUT/tests.txt"
  done
fi

if [ "$MODE" = ncu ]; then
  for c in tree $CANDS; do
    if [ "$c" = tree ]; then t=$PWD; else t=$(tree_with "$c"); fi
    for spec in "prefill --h-q 128" "decode --h-q 128"; do
      name=${c}_$(echo "$spec" | tr -d '-' | tr ' ' '_')
      echo "==== $c $spec" >> "$OUT/ncu.txt"
      (cd "$t" && export PYTHONPATH="$t" && timeout "${NCU_S:-60}" "$NCU" --profile-from-start off --section SpeedOfLight \
        --section SchedulerStats --section WarpStateStats --section LaunchStats --print-details all -f -o "/tmp/$name" \
        python bench/profile_call.py $spec --proxy sm120 > "/tmp/$name.log" 2>&1) || tail -5 "/tmp/$name.log" >> "$OUT/ncu.txt"
      "$NCU" --import "/tmp/$name.ncu-rep" --page details --print-details all >> "$OUT/ncu.txt" 2>&1
    done
  done
fi
