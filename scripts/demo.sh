#!/usr/bin/env bash
# The main job on any machine (CPU or GPU): create/reuse the core environment, show the environment
# and the routes, plan GLM-5 on an RTX PRO 6000 class GPU (sm120) with an FP8 KV cache, then run a
# small DSA attention layer (indexer, top-k, sparse MLA over FP8 paged caches) through the routed ops,
# each op compared with the reference (on a CPU: the Triton kernels in the Triton interpreter).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/venv.sh" core | tail -n 1)"
cli="$(dirname "$py")/nsa-backend"
"$cli" doctor
"$cli" plan --model glm-5 --arch sm120 --kv-cache-dtype fp8_e4m3 --tp 2
"$cli" demo "$@"
echo "nsa-backend CLI: $cli"
