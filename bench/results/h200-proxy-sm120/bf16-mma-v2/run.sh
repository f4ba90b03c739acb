#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go).
set -u
OUT=${OUT:-.}
D=bench/results/h200-proxy-sm120/bf16-mma-v2
P="DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120"
export PYTHONPATH=$PWD
mkdir -p "$OUT/gpu-tests"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
# the kernel's GPU tests under the proxy (bf16 decode and bf16 prefill), the sm_90 Gluon prefills natively
timeout 250 env $P python -m pytest -q -m gpu tests/ops/test_sparse_mla_decode_bf16_mma_v2.py tests/ops/test_sparse_mla_prefill_mma_v2.py \
  -p no:cacheprovider -rA -s > "$OUT/gpu-tests/bf16_mma_v2.txt" 2>&1
# the sweep: tl tile against the Gluon kernel under the sm120 proxy, same process
env $P OUT=$OUT python $D/sweep.py
python -m pytest -q -m gpu tests/ops/test_sparse_mla_prefill_gluon.py tests/ops/test_sparse_mla_prefill_gluon_fewhead.py \
  -p no:cacheprovider -rA > "$OUT/gpu-tests/sm90_prefill.txt" 2>&1
