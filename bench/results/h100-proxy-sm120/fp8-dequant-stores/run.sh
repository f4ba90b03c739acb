#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go). CAND: a folder
# with sparse_mla_prefill/sm80_gluon.py and sparse_mla_decode/sm89_gluon.py (the candidate).
# 1. ab.py: the candidate's fp8 decode against the tree's, same process;
# 2. the fp8 decode's GPU tests in a copy of the tree with the candidate in place (fuzz with the fp8 units, fuzz
#    with sm_86's integer decoding, the module's other GPU tests), three processes;
# 3. Nsight Compute (memory tables) of one fp8 decode call at 128 heads, tree and candidate (PROFILE=0: not run).
set -u
OUT=${OUT:-.}
D=bench/results/h100-proxy-sm120/fp8-dequant-stores
CAND=${CAND:-cand/dq8}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  python -c "import triton; print('triton', triton.__version__)"; } > "$OUT/env.txt"
timeout "${AB_S:-200}" env DISABLE_MMA_V3=1 OUT="$OUT" CAND="$CAND" python $D/ab.py > "$OUT/ab.log" 2>&1 \
  || echo "ab: rc=$?" >> "$OUT/ab.log"

t=/tmp/tree_cand
rm -rf "$t" && mkdir -p "$t" && cp -r nsa_backend nsa_backend_cli integrations tests bench pyproject.toml "$t"/
cp "$CAND/sparse_mla_prefill/sm80_gluon.py" "$t/nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py"
cp "$CAND/sparse_mla_decode/sm89_gluon.py" "$t/nsa_backend/kernels/sparse_mla_decode/sm89_gluon.py"
T="timeout ${TESTS_S:-300} env DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 PYTHONPATH=$t python -m pytest -q -m gpu -p no:cacheprovider -rfE -s"
M=tests/ops/test_sparse_mla_decode_mma_v2.py
(cd "$t" && $T "$M::test_decode_mma_v2_gpu_fuzz[None]" > /tmp/fz_native.txt 2>&1) &
(cd "$t" && $T "$M::test_decode_mma_v2_gpu_fuzz[sm86]" > /tmp/fz_sm86.txt 2>&1) &
(cd "$t" && $T $M -k "not fuzz" > /tmp/fz_others.txt 2>&1) &
wait
for k in native sm86 others; do echo "==== $k"; tail -15 /tmp/fz_$k.txt; done > "$OUT/tests.txt"

if [ "${PROFILE:-1}" = 1 ]; then
  for c in tree cand; do
    if [ "$c" = tree ]; then r=$PWD; else r=$t; fi
    (cd "$r" && PYTHONPATH="$r" timeout "${NCU_S:-90}" "$NCU" --profile-from-start off --section SpeedOfLight \
      --section MemoryWorkloadAnalysis_Tables -f -o "/tmp/ncu_$c" python bench/profile_call.py decode --h-q 128 \
      --proxy sm120 > "/tmp/ncu_$c.log" 2>&1) || tail -5 "/tmp/ncu_$c.log" >> "$OUT/ncu.txt"
    { echo "==== $c"; "$NCU" --import "/tmp/ncu_$c.ncu-rep" --page details; } >> "$OUT/ncu.txt" 2>&1
  done
fi
