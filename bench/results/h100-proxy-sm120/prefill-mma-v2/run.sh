#!/usr/bin/env bash
# The commands of this folder's results, from the repository root on the GPU (OUT: where they go).
set -u
OUT=${OUT:-.}
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
# the sweep: tl tile against the Gluon kernel under the sm120 proxy
DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 OUT=$OUT python bench/results/h100-proxy-sm120/prefill-mma-v2/sweep.py
# the kernels' GPU tests: the prefill and decode mma.sync kernels under the proxy, the sm_90 decode kernels natively
DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 python -m pytest -q -m gpu tests/ops/test_sparse_mla_prefill_mma_v2.py \
  -p no:cacheprovider -rA -s > "$OUT/gpu-tests/prefill_mma_v2.txt" 2>&1
DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 python -m pytest -q -m gpu tests/ops/test_sparse_mla_decode_mma_v2.py \
  -p no:cacheprovider -rA -s > "$OUT/gpu-tests/decode_mma_v2.txt" 2>&1
python -m pytest -q -m gpu tests/ops/test_sparse_mla_decode_gluon_ws.py tests/ops/test_sparse_mla_decode_gluon.py \
  -p no:cacheprovider -rA > "$OUT/gpu-tests/decode_sm90.txt" 2>&1
# the fuzz against a kernel whose scores leave out the rope product (must fail)
cp nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py /tmp/sm80_gluon.py
sed -i 's/        b_s0 = mma_v2(qr_smem.load(OP_A), kr.permute((1, 0)).load(OP_B), b_s0)/        pass/' \
  nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py
DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_FUZZ_CASES=20 python -m pytest -q -m gpu \
  tests/ops/test_sparse_mla_prefill_mma_v2.py -k fuzz -p no:cacheprovider 2>&1 | tail -6 \
  > "$OUT/gpu-tests/prefill_mma_v2_without_rope_product.txt"
cp /tmp/sm80_gluon.py nsa_backend/kernels/sparse_mla_prefill/sm80_gluon.py
