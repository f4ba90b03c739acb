"""Time the package first on ``PYTHONPATH`` under the mma.sync proxy with the forced arch's shared memory per SM, on
its default routes (CUDA graph, two passes, L2 evicted before each call):

- the sparse MLA decode over the fp8_ds_mla cache (top-k 2048, s_q 1) at the 32-head tile's head counts;
- the paged indexer logits at 64 heads, next_n 1 (D 128, pages of 64 keys).

    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=<arch> PYTHONPATH=<tree> python ab.py <label> <arch>

One JSON line per case: ``ms``, ``of_copy`` (paged: cache bytes read per second over the run's copy rate) and a
checksum of the output.
"""

import json
import sys

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

DECODE_SHAPES = ((128, 128), (128, 64), (32, 64), (128, 32))
PAGED_SHAPES = ((128, 8192), (128, 32768), (128, 65536), (64, 32768), (16, 8192), (8, 65536))


def main(label: str, arch: str) -> None:
    proxy.limit_shared_memory_per_sm(arch)
    dev = torch.device("cuda")
    copy = copy_gbps(dev, 2 * 2**30)
    print(json.dumps(dict(tree=label, arch=arch, op="copy", gbps=copy)), flush=True)
    for p in range(2):
        for B, h_q in DECODE_SHAPES:
            a = decode_inputs(B, 1, h_q, 2048, dev)

            def call(a=a):
                return sparse_mla_decode_triton(a["q"], a["kv_cache"], a["indices"], a["sm_scale"])[0]

            out = call().float()
            ms = bench_ms(call, graph=True)
            print(json.dumps(dict(tree=label, arch=arch, op="decode_fp8", p=p, B=B, h_q=h_q, ms=ms,
                                  cksum=float(out.double().sum()))), flush=True)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for B, length in PAGED_SHAPES:
            q, cache, w, ctx, table = paged_inputs(B, length, 1, 64, 128)
            meta = nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl="triton")

            def paged(q=q, cache=cache, w=w, ctx=ctx, table=table, meta=meta, length=length):
                return nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, length, impl="triton")

            out = paged()
            ms = bench_ms(paged, graph=True)
            print(json.dumps(dict(tree=label, arch=arch, op="paged", p=p, B=B, L=length, ms=ms,
                                  of_copy=B * length * 132 / ms / 1e6 / copy,
                                  cksum=float(out[out.isfinite()].double().sum()))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
