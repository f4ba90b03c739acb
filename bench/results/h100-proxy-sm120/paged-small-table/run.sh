#!/bin/bash
# The commands behind this folder, on one NVIDIA H100 80GB HBM3 (torch 2.11, triton 3.6), from the repository root.
# The sweeps and indexer-d6a8cd0/ ran at d6a8cd0 (before its entries served sm_86 / sm_89); sweep.py names the
# launches so that it reproduces the same variants on later commits.
set -e
export PYTHONPATH=$PWD
D=bench/results/h100-proxy-sm120/paged-small-table
G="DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0"
# chunk plans and the sm_120 entries on the other parts: paged_<arch>.jsonl, paged2_<arch>.jsonl
for a in sm120 sm89; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/sweep.py $a 64x2,32x1,32x2 2,3,4,5,6; done
for a in sm86 sm89; do env $G NSA_BACKEND_FORCE_ARCH=$a python $D/sweep.py $a 64x2,32x1,32x2 3,4,6; done
# the suite's indexer family under the proxy: indexer-d6a8cd0/
python -m nsa_backend.bench --proxy sm120 --ops indexer --out $D/indexer-d6a8cd0 --no-plots --no-progress \
  --git-commit d6a8cd0
# fp8 products: Triton's own sm_90 code (fp16 mma.sync) against sm_89 code (e4m3 mma.sync) built by ptxas for
# sm_90 through a wrapper that swaps the target: exp_<mode>.jsonl, sass_<mode>.json
T=$(python -c "import triton, os; print(os.path.dirname(triton.__file__))")
cat > /tmp/ptxas89 <<EOW
#!/bin/bash
args=(); for a in "\$@"; do case "\$a" in --gpu-name=sm_89) a=--gpu-name=sm_90;; esac; args+=("\$a"); done
exec $T/backends/nvidia/bin/ptxas "\${args[@]}"
EOW
chmod +x /tmp/ptxas89
S="NSA_BACKEND_FORCE_ARCH=sm120 TRITON_OVERRIDE_ARCH=sm89 TRITON_PTXAS_PATH=/tmp/ptxas89"
env $G NSA_BACKEND_FORCE_ARCH=sm120 TRITON_CACHE_DIR=/tmp/tc-mma16 python $D/fp8_codegen.py mma16 sm120
env $G $S TRITON_CACHE_DIR=/tmp/tc-mma89 python $D/fp8_codegen.py mma89 sm120
for m in mma16 mma89; do
  python -c "import json, sys; from nsa_backend.bench import proxy
json.dump(proxy.scan_sass(sys.argv[1], 101376), open(sys.argv[2], 'w'), indent=1)" /tmp/tc-$m $D/sass_$m.json
done
# chunk plans with the sm_89-code builds: paged89_<arch>.jsonl; their registers: res89_<arch>.txt
for a in sm120 sm89; do
  env $G NSA_BACKEND_FORCE_ARCH=$a TRITON_OVERRIDE_ARCH=sm89 TRITON_PTXAS_PATH=/tmp/ptxas89 \
    TRITON_CACHE_DIR=/tmp/tc89-$a python $D/sweep.py $a 64x2,32x1,32x2,64x1 3,4,5
  for c in $(find /tmp/tc89-$a -name "*paged_logits*.cubin"); do
    echo "$c $(python -c "import json, sys; m = json.load(open(sys.argv[1])); print(m['num_warps'], m['shared'])" \
      ${c%.cubin}.json) $($T/backends/nvidia/bin/cuobjdump -res-usage $c | grep -o 'REG:[0-9]*')"
  done
done
# GPU tests under the proxy with the new table: gpu-tests/
mkdir -p $D/gpu-tests
for a in sm89 sm86 sm120; do
  env $G NSA_BACKEND_FORCE_ARCH=$a python -m pytest -q -x -m gpu tests/ops/test_indexer.py -p no:cacheprovider -n 8 \
    > $D/gpu-tests/indexer_$a.log
done
# after the change: the suite's indexer family with sm_89's configuration (indexer-sm89/, labelled "table") and
# the sparse MLA family, which the change does not touch (sparse_mla-d6a8cd0/)
python -m nsa_backend.bench --proxy sm89 --ops indexer --out $D/indexer-sm89 --no-plots --no-progress --git-commit table
python -m nsa_backend.bench --proxy sm120 --ops sparse_mla --out $D/sparse_mla-d6a8cd0 --no-plots --no-progress \
  --git-commit d6a8cd0
