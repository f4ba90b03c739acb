#!/bin/bash
# The commands behind this folder, on one NVIDIA H100 80GB HBM3 (torch 2.11, triton 3.6), from the repository root,
# with POW2_DEQUANT_WITH_FP8_UNIT = True (the dequantisation on every arch) for the A/B.
set -e
export PYTHONPATH=$PWD
D=bench/results/h100-proxy-sm120/pow2-dequant
G="DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0"
# kv_scale_format="pow2" against the general path: pow2ab_<arch>.jsonl
for a in sm120 sm89 sm86; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/pow2_ab.py $a; done
# GPU tests of the family (decode fuzz with kv_scale_format="pow2" on half its pow2 cases): gpu-tests/
for a in sm120 sm86; do
  env $G NSA_BACKEND_FORCE_ARCH=$a python -m pytest -q -x -m gpu tests/ops/test_sparse_mla.py -p no:cacheprovider -n 8 \
    > $D/gpu-tests/sparse_mla_$a.log
done
# the same-numbers test against a broken conversion (the second pair's selector 0xB2A3 instead of 0xB3A2): it fails
sed -i 's/prmt.b32 b, \$2, 0, 0xB3A2;/prmt.b32 b, $2, 0, 0xB2A3;/' nsa_backend/kernels/sparse_mla_prefill/portable.py
env $G NSA_BACKEND_FORCE_ARCH=sm120 python -m pytest -q -x -m gpu tests/ops/test_sparse_mla.py -k pow2 \
  -p no:cacheprovider > $D/gpu-tests/broken_conversion.log || true
# with the shipped rule (POW2_DEQUANT_WITH_FP8_UNIT = False): gpu-tests/final/
mkdir -p $D/gpu-tests/final
for a in sm86 sm120; do
  env $G NSA_BACKEND_FORCE_ARCH=$a python -m pytest -q -x -m gpu tests/ops/test_sparse_mla.py -p no:cacheprovider -n 8 \
    > $D/gpu-tests/final/sparse_mla_$a.log
done
# sm_80's configuration with the shipped rule: pow2ab_sm80.jsonl
env $G NSA_BACKEND_FORCE_ARCH=sm80 python $D/pow2_ab.py sm80
