#!/bin/bash
# The commands behind this folder, on one H200 (torch 2.11, triton 3.6), from the repository root.
# BASE: a checkout of the commit before the change (git archive <commit> | tar -x -C BASE); the working tree
# holds the change. Each A/B alternates the two trees, each with its own Triton cache.
D=bench/results/h200-proxy-sm120/reread-and-head-slices
P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0"
S=bench/results/h100-proxy-sm120/fp8-decode-shared-keys/decode_ab.py
for pass in 1 2; do
  # sparse MLA decode, fp8_ds_mla, CUDA graph: decode_ab.jsonl ("reread" is the working tree)
  env $P TRITON_CACHE_DIR=/tmp/tc-main PYTHONPATH=$BASE python $S main sm120
  env $P TRITON_CACHE_DIR=/tmp/tc-reread PYTHONPATH=$PWD python $S reread sm120
done
for pass in 1 2; do
  # paged indexer logits, H 64, next_n 1 / 2, CUDA graph: paged_ab.jsonl (this run's tree also sliced the
  # next_n 2 tile, which the change then left out: 0.96x)
  env $P TRITON_CACHE_DIR=/tmp/tc-main PYTHONPATH=$BASE python $D/paged_ab.py main
  env $P TRITON_CACHE_DIR=/tmp/tc-new PYTHONPATH=$PWD python $D/paged_ab.py new
done
# the same on the sm_89 and sm_86 configurations: archs_ab.jsonl
for arch in sm89 sm86; do
  for t in main:$BASE sliced:$PWD reread:$PWD; do
    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=$arch TRITON_CACHE_DIR=/tmp/tx-${t%%:*}-$arch \
      PYTHONPATH=${t#*:} python $D/archs_ab.py ${t%%:*} $arch
  done
done
# limits of the run: limits.jsonl
env $P PYTHONPATH=$PWD python $S limits sm120 limits  # with its SHAPES list emptied
# GPU tests under the proxy: fuzz_*.txt
env $P python -m pytest -q -x -m gpu tests/ops/test_sparse_mla.py -p no:cacheprovider -n 4
env $P python -m pytest -q -x -m gpu tests/ops/test_indexer.py -p no:cacheprovider -n 4
for a in sm86 sm89 sm120; do
  DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=$a \
    python -m pytest -q -x -m gpu tests/ops/test_indexer.py tests/ops/test_sparse_mla.py -p no:cacheprovider -n 8
done
# Nsight Compute, one launch each (ncu_summary.md)
for w in paged1 decode64 mhc4096; do
  env $P /usr/local/cuda/bin/ncu --profile-from-start off --set full --import-source no \
    -k regex:"_indexer_paged_logits_kernel|_sparse_mla_fwd_kernel|_mhc_prenorm_gemm" -c 1 -o /tmp/$w \
    python $D/ncu_target.py $w
done
