"""Time the tl sparse MLA decode (fp8_ds_mla, CUDA graph) of the package first on ``PYTHONPATH`` under the proxy.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0 PYTHONPATH=<tree> \\
        python decode_ab.py <label> sm120 decode [s32 | h16 | w8 | cap32]

One JSON line per shape (``ms``, useful ``tflops``). Flags change the configuration tables in the process
before the first call: ``s32`` the 32-head tile of the 100 KiB parts shares its keys, ``h16`` every program
takes 16 heads there, ``w8`` the 32-head tile runs 8 warps, ``cap32`` the sm80 class takes 32 heads per
program; ``prefill`` times the bf16 prefill at s_q 4096 instead; ``limits`` prints the copy and matmul rates.
"""

import json
import sys

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.sparse_mla import DECODE_SCALE_FORMAT, decode_inputs, prefill_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import sparse_mla as cfg
from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

label = sys.argv[1]
arch = sys.argv[2] if len(sys.argv) > 2 else "sm120"
flags = sys.argv[3:]
proxy.limit_shared_memory_per_sm(arch)
if "cap32" in flags:
    cfg.MAX_BLOCK_H["sm80"] = 32
if "h16" in flags:
    cfg.MAX_BLOCK_H["small"] = 16
if "s32" in flags:
    cfg.DECODE_FP8_CONFIGS["small"][32] = (cfg.AttnConfig(32, 32, 4, 1, share_keys=True),)
if "w8" in flags:
    cfg.DECODE_FP8_CONFIGS["small"][32] = (cfg.AttnConfig(32, 32, 8, 1, share_keys=True),)
SHAPES = [] if "prefill" in flags else [(128, 1, h) for h in (128, 64, 32, 16)] + [(128, 2, 64), (32, 1, 64)]
dev = torch.device("cuda")
if "limits" in flags:
    from nsa_backend.bench.limits import measure_limits
    from nsa_backend.kernels.aot import SHARED_MEMORY_LIMIT

    lim = measure_limits(dev, quick=False, mma_sync_smem=SHARED_MEMORY_LIMIT[120 if arch == "sm120" else 80])
    print(json.dumps(dict(tree=label, op="limits", **lim)), flush=True)
for B, s_q, h in SHAPES:
    a = decode_inputs(B, s_q, h, 2048, dev)
    ms = bench_ms(lambda a=a: nb.sparse_mla_decode(**a, kv_scale_format=DECODE_SCALE_FORMAT, impl="triton"),
                  graph=True)
    flops = 2 * B * s_q * h * 2048 * (576 + 512)
    print(json.dumps(dict(tree=label, op="decode", B=B, s_q=s_q, h_q=h, ms=ms, tflops=flops / ms / 1e9)), flush=True)
    del a
for h in (64,) if "prefill" in flags else ():
    a = prefill_inputs(4096, 32768, h, 2048, dev)
    ms = bench_ms(lambda a=a: flash_mla_sparse_fwd_triton(a["q"], a["kv"], a["indices"], a["sm_scale"]))
    flops = 2 * 4096 * h * 2048 * (576 + 512)
    print(json.dumps(dict(tree=label, op="prefill", s_q=4096, h_q=h, ms=ms, tflops=flops / ms / 1e9)), flush=True)
