#!/bin/bash
# The commands behind this folder, on one H100 80GB HBM3 (torch 2.11, triton 3.6), from the repository root.
# BASE: a checkout of the commit before the change (git archive <commit> | tar -x -C BASE); the working tree holds
# the change. Each tree has its own Triton cache.
D=bench/results/h100-proxy-sm120/decode-64-keys-and-paged-plan
G="DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0"
# the shipped routes of both trees, alternating: ab.jsonl
for a in sm120 sm89 sm86; do
  for t in main:$BASE new:$PWD; do
    env $G NSA_BACKEND_FORCE_ARCH=$a TRITON_CACHE_DIR=/tmp/tc-${t%%:*} PYTHONPATH=${t#*:} python $D/ab.py ${t%%:*} $a
  done
done
export PYTHONPATH=$PWD
# the mHC square sums from a second read (mhc_sq_ahead.diff applied to the tree): mhc_sq_ahead.jsonl
env $G NSA_BACKEND_FORCE_ARCH=sm120 python $D/sweeps.py mhc sm120
# paged logits chunk plans: paged_sweep_<arch>.jsonl, paged_r4_<arch>.jsonl, paged_r3_sm86.jsonl
env $G NSA_BACKEND_FORCE_ARCH=sm120 python $D/sweeps.py paged sm120 \
  r6,r5cap96,r6cap80,r6cap96,r10cap96,r4cap96,r5cap96s2,r6cap80s2,r5cap96s4,r8
for a in sm89 sm86; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/sweeps.py paged $a r6,r5cap96,r6cap80,r4cap96; done
for a in sm120 sm89 sm86; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/sweeps.py paged $a r6,r4,r5cap96; done
env $G NSA_BACKEND_FORCE_ARCH=sm86 python $D/sweeps.py paged sm86 r6,r4,r3
# sparse MLA decode tiles: decode_sweep_sm120.jsonl, decode_sweep_64keys_<arch>.jsonl, decode_sweep_noreread_sm120.jsonl
env $G NSA_BACKEND_FORCE_ARCH=sm120 python $D/sweeps.py decode sm120 base,s2,s2ia,s1ia,n16s2ia,n16s3ia,n64s1,w8,w8s2ia
for a in sm120 sm89 sm86; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/sweeps.py decode $a base,n64s1,n64w8,n64w8ia; done
env $G NSA_BACKEND_FORCE_ARCH=sm120 python $D/sweeps.py decode sm120 base,n64s1,n64s1noreread
# GPU tests under the proxy with the final tables: gpu-tests/
for a in sm120 sm86 sm89; do
  env $G NSA_BACKEND_FORCE_ARCH=$a python -m pytest -q -x -m gpu tests/ops/test_indexer.py -p no:cacheprovider -n 8
  env $G NSA_BACKEND_FORCE_ARCH=$a python -m pytest -q -x -m gpu tests/ops/test_sparse_mla.py -p no:cacheprovider -n 8
done
