"""The paged logits (H 64, next_n 1) and the fp8 sparse MLA decode under the proxy with another arch's
configurations (``NSA_BACKEND_FORCE_ARCH``), for the package first on ``PYTHONPATH``.

    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=<arch> PYTHONPATH=<tree> \\
        python archs_ab.py <main | sliced | reread> <arch>

``main`` times both ops; ``sliced`` times the paged logits with the two-slice tile set for 64 heads and one row
(the table of the run's tree had it for sm_120 only); ``reread`` times the decode.
"""

import json
import sys

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.sparse_mla import DECODE_SCALE_FORMAT, decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import indexer as ci


def main(label: str, arch: str) -> None:
    proxy.limit_shared_memory_per_sm(arch)
    if label == "sliced":
        sliced = {(64, 1): ci.LogitsConfig(64, 64, 4, 3, row_loop=True, head_slices=2, resident=6)}
        ci._paged_tuned = lambda kind, a: sliced
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if label in ("main", "sliced"):
        for length in (8192, 32768):
            q, cache, w, ctx, table = paged_inputs(128, length, 1, 64, 128)
            meta = nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl="triton")

            def call(q=q, cache=cache, w=w, ctx=ctx, table=table, meta=meta, length=length):
                return nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, length, impl="triton")

            ms = bench_ms(call, graph=True)
            print(json.dumps(dict(tree=label, arch=arch, op="paged", next_n=1, L=length, ms=ms,
                                  gbps=128 * length * 132 / ms / 1e6)), flush=True)
    if label in ("main", "reread"):
        for h in (128, 64, 32):
            a = decode_inputs(128, 1, h, 2048, torch.device("cuda"))
            ms = bench_ms(lambda a=a: nb.sparse_mla_decode(**a, kv_scale_format=DECODE_SCALE_FORMAT, impl="triton"),
                          graph=True)
            print(json.dumps(dict(tree=label, arch=arch, op="decode", h_q=h, ms=ms)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
