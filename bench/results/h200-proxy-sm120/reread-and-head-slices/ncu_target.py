"""One op under the proxy (sm_120's configurations and shared memory per SM) for Nsight Compute: three warm-up
calls, then one call between ``cudaProfilerStart`` and ``cudaProfilerStop`` (``ncu --profile-from-start off``).

    python ncu_target.py <paged1 | paged2 | decode<h_q> | mhc<M>>
"""

import sys

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.sparse_mla import DECODE_SCALE_FORMAT, decode_inputs


def main(what: str) -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    if what.startswith("paged"):
        q, cache, w, ctx, table = paged_inputs(128, 32768, int(what[-1]), 64, 128)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl="triton")

        def call():
            nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, 32768, impl="triton")
    elif what.startswith("mhc"):
        m = int(what[3:])
        a = torch.randn(m, 28672, device=dev).bfloat16()
        b = torch.randn(24, 28672, device=dev)
        d = torch.empty(m, 24, device=dev)
        s = torch.empty(m, device=dev)

        def call():
            nb.tf32_hc_prenorm_gemm(a, b, d, s, None, impl="triton")
    else:
        inputs = decode_inputs(128, 1, int(what[len("decode"):]), 2048, dev)

        def call():
            nb.sparse_mla_decode(**inputs, kv_scale_format=DECODE_SCALE_FORMAT, impl="triton")
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1])
