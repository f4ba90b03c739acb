"""Time the paged indexer logits (H 64, D 128, B 128, CUDA graph) of the package first on ``PYTHONPATH`` under the
proxy, with sm_120's shared memory per SM.

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0 PYTHONPATH=<tree> python paged_ab.py <label>

One JSON line per (next_n, context): ``ms``, ``gbps`` (cache bytes over time) and a checksum of the logits.
"""

import json
import sys

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.timing import bench_ms


def main(label: str) -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for next_n in (1, 2):
        for length in (8192, 32768):
            q, cache, w, ctx, table = paged_inputs(128, length, next_n, 64, 128)
            meta = nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl="triton")

            def call(q=q, cache=cache, w=w, ctx=ctx, table=table, meta=meta, length=length):
                return nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, length, impl="triton")

            out = call().clone()
            ms = bench_ms(call, graph=True)
            print(json.dumps(dict(tree=label, op="paged", next_n=next_n, L=length, ms=ms,
                                  gbps=128 * length * 132 / ms / 1e6,
                                  cksum=float(out[out.isfinite()].double().sum()))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
