#!/usr/bin/env bash
# The commands of this folder, from the repository root (OUT: where their files go). Each candidate (CANDS; the
# patch cand-<name>.patch of this folder, against 9256cca) is applied to a copy of the tree in /tmp/tree_<name>.
# `run.sh aot`: the AOT table of the tree and of each candidate (aot.py, for sm_120 and sm_86) with the Triton this
#   Python imports, into $OUT/aot.jsonl (no GPU);
# `run.sh ab`: each candidate's fp8 decode timed against the tree's, same process, under the proxy (ab_decode.py);
# `run.sh check`: each candidate's GPU tests of the fp8 decode under the proxy (the 300-case fuzz with the fp8
#   units and with sm_86's integer decoding, and the other GPU tests of that file);
# `run.sh ncu`: Nsight Compute (throughput, scheduler and warp-state statistics) of one fp8 decode call at h_q 32 and
#   128 (bench/profile_call.py, B 128) for the tree and each candidate, into $OUT/ncu.txt.
set -u
OUT=${OUT:-.}
CANDS=${CANDS:-early lat3}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODE=${1:-ab}

tree_with() {  # a copy of the tree with candidate $1 applied
  local t=/tmp/tree_$1
  rm -rf "$t" && mkdir -p "$t" && cp -r nsa_backend nsa_backend_cli integrations tests bench pyproject.toml "$t"/
  if command -v patch > /dev/null; then patch -s -p1 -d "$t" < "$HERE/cand-$1.patch"
  else (cd "$t" && git apply "$HERE/cand-$1.patch"); fi && echo "$t"
}

if [ "$MODE" = aot ]; then
  for c in tree $CANDS; do
    if [ "$c" = tree ]; then t=$PWD; else t=$(tree_with "$c"); fi
    PYTHONPATH="$t${TRITON_PATH:+:$TRITON_PATH}" python "$HERE/aot.py" 120 86 2>> "$OUT/aot.log" \
      | sed "s/^{/{\"cand\": \"$c\", /" >> "$OUT/aot.jsonl"
  done
fi

if [ "$MODE" = ab ]; then
  { nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
    python -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"; } > "$OUT/env.txt"
  specs=""
  for c in $CANDS; do specs="$specs $c:$(tree_with "$c")/nsa_backend/kernels/sparse_mla_decode/sm89_gluon.py"; done
  timeout "${AB_S:-330}" env DISABLE_MMA_V3=1 PYTHONPATH=$PWD OUT="$OUT" CANDS="$specs" \
    python "$HERE/ab_decode.py" > "$OUT/ab.log" 2>&1 || echo "ab: rc=$?" >> "$OUT/ab.log"
fi

if [ "$MODE" = check ]; then
  P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120"
  F=tests/ops/test_sparse_mla_decode_mma_v2.py
  for c in $CANDS; do
    t=$(tree_with "$c")
    T="timeout ${TESTS_S:-200} env $P PYTHONPATH=$t python -m pytest -q -m gpu -p no:cacheprovider -rfE"
    (cd "$t" && $T $F -k "not fuzz" > "/tmp/fz_${c}_others.txt" 2>&1) &
    (cd "$t" && $T "$F::test_decode_mma_v2_gpu_fuzz[None]" > "/tmp/fz_${c}_fuzz.txt" 2>&1) &
    (cd "$t" && $T "$F::test_decode_mma_v2_gpu_fuzz[sm86]" > "/tmp/fz_${c}_fuzz_sm86.txt" 2>&1) &
  done
  wait
  for c in $CANDS; do
    for k in others fuzz fuzz_sm86; do echo "==== $c $k"; tail -4 "/tmp/fz_${c}_$k.txt"; done >> "$OUT/tests.txt"
  done
fi

if [ "$MODE" = ncu ]; then
  for c in tree $CANDS; do
    if [ "$c" = tree ]; then t=$PWD; else t=$(tree_with "$c"); fi
    for h in 32 128; do
      echo "==== $c h_q $h" >> "$OUT/ncu.txt"
      (cd "$t" && PYTHONPATH="$t" timeout "${NCU_S:-90}" "$NCU" --profile-from-start off --section SpeedOfLight \
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis -f -o "/tmp/ncu_${c}_$h" \
        python bench/profile_call.py decode --b 128 --h-q "$h" --proxy sm120 > "/tmp/ncu_${c}_$h.log" 2>&1) \
        || tail -5 "/tmp/ncu_${c}_$h.log" >> "$OUT/ncu.txt"
      "$NCU" --import "/tmp/ncu_${c}_$h.ncu-rep" --page details --print-details all >> "$OUT/ncu.txt" 2>&1
    done
  done
fi
