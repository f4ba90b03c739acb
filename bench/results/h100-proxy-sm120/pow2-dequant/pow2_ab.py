"""fp8 decode: kv_scale_format="pow2" (integer dequantisation) against the general path, same process, same inputs
(caches with power-of-two scales), CUDA graph, two passes; outputs compared bit for bit.

    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=<arch> python pow2_ab.py <arch>

Run at the commit that added the dequantisation with it taken on every arch (``POW2_DEQUANT_WITH_FP8_UNIT = True``
in ``nsa_backend/configs/sparse_mla.py``; the shipped value keeps sm_89 / sm_120 on their fp8 unit).
"""

import functools
import json
import sys

import torch

from nsa_backend.bench import proxy
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

arch = sys.argv[1]
dev = torch.device("cuda")
proxy.limit_shared_memory_per_sm(arch)


def emit(**r) -> None:
    print(json.dumps(dict(arch=arch, **r)), flush=True)


SHAPES = ((128, 1, 128), (128, 1, 64), (128, 1, 32), (128, 1, 16), (32, 1, 64), (128, 2, 128), (32, 1, 16))
for B, s_q, h_q in SHAPES:
    a = decode_inputs(B, s_q, h_q, 2048, dev)
    kv = a["kv_cache"]
    rows = kv.view(-1, kv.shape[-1])
    sc = rows[:, 512:528].contiguous().view(torch.float32)
    rows[:, 512:528] = torch.exp2(torch.round(torch.log2(sc.clamp(min=2.0**-60)))).view(torch.uint8).view(-1, 16)
    args = (a["q"], kv, a["indices"], a["sm_scale"])
    outs = {}
    for p in range(2):
        for fmt in ((None, "pow2") if p == 0 else ("pow2", None)):
            call = functools.partial(sparse_mla_decode_triton, *args, kv_scale_format=fmt)
            o = call()
            outs.setdefault(fmt, o)
            ms = bench_ms(call, 10, 60, graph=True)
            emit(B=B, s_q=s_q, h_q=h_q, fmt=fmt or "general", p=p, ms=ms)
    same = all(torch.equal(x, y) for x, y in zip(outs[None], outs["pow2"]))
    emit(B=B, s_q=s_q, h_q=h_q, same=same)
