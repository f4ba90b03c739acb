#!/usr/bin/env bash
# Nsight Compute (full set) of one call of each mma.sync Gluon kernel at 128 heads under the sm120 proxy, from the
# repository root on the GPU: the fp8 decode, the bf16 decode, the bf16 prefill. OUT/ncu.txt: their details pages.
set -u
OUT=${OUT:-.}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
export PYTHONPATH=$PWD
for spec in "decode --h-q 128" "decode --h-q 128 --kv bf16" "prefill --h-q 128"; do
  name=$(echo "$spec" | tr -d '-' | tr ' ' '_')
  echo "==== $spec" >> "$OUT/ncu.txt"
  timeout ${NCU_S:-60} "$NCU" --profile-from-start off --set full -f -o "/tmp/$name" \
    python bench/profile_call.py $spec --proxy sm120 > "/tmp/$name.log" 2>&1 || tail -5 "/tmp/$name.log" >> "$OUT/ncu.txt"
  "$NCU" --import "/tmp/$name.ncu-rep" --page details >> "$OUT/ncu.txt" 2>&1
done
