"""One proxy run (mode: a name for the records): the same-run limits, the shipped sm_120 launches of the fp8 indexer
logits, a bf16 kernel for comparison, and the logits of small inputs against the reference first.

    python fp8_codegen.py <mode> sm120
"""
import functools
import json
import sys

import torch

from nsa_backend import reference as ref
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs, ragged_inputs
from nsa_backend.bench.limits import measure_limits
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels import indexer as ki
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

mode, arch = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")


def emit(**r) -> None:
    print(json.dumps(dict(mode=mode, arch=arch, **r)), flush=True)


proxy.limit_shared_memory_per_sm(arch)


def rel(out, want):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), fin)
    return ((out.float() - want.float())[fin].abs().max() / want.float()[fin].abs().max()).item()


# correctness first (small inputs)
for H, nn in ((64, 1), (64, 2), (32, 1), (32, 2)):
    q, cache, w, ctx, table = paged_inputs(4, 2048, nn, H, 128)
    ctx[1] = 777
    out = ki.fp8_paged_mqa_logits_triton(q, cache, w, ctx, table, None, 2048)
    emit(op="paged_check", H=H, next_n=nn, rel=rel(out, ref.fp8_paged_mqa_logits(q, cache, w, ctx, table, None, 2048)))
for H in (64, 32):
    q, kv, w, ks, ke = ragged_inputs(256, 1024, H, 128)
    out = ki.fp8_mqa_logits_triton(q, kv, w, ks, ke)
    emit(op="ragged_check", H=H, rel=rel(out, ref.fp8_mqa_logits(q, kv, w, ks, ke)))

lim = measure_limits(dev, False, mma_sync_smem=99 * 1024)
emit(op="limits", **lim)
copy = lim["copy_gbps"]
for H, nn in ((64, 1), (64, 2), (32, 1), (32, 2)):
    for B, L in ((128, 8192), (128, 32768), (128, 65536)):
        q, cache, w, ctx, table = paged_inputs(B, L, nn, H, 128)
        call = functools.partial(ki.fp8_paged_mqa_logits_triton, q, cache, w, ctx, table, None, L)
        ms = bench_ms(call, graph=True)
        flops = 2.0 * B * L * nn * H * 128
        emit(op="paged", H=H, next_n=nn, B=B, L=L, ms=ms, of_copy=B * L * 132 / ms / 1e6 / copy,
             of_fp8=flops / ms / 1e9 / lim["fp8_tflops"], tflops=flops / ms / 1e9)
for H in (64, 32):
    for N in (8192, 32768):
        S = 4096
        q, kv, w, ks, ke = ragged_inputs(S, N, H, 128)
        call = functools.partial(ki.fp8_mqa_logits_triton, q, kv, w, ks, ke)
        ms = bench_ms(call)
        flops = 2.0 * H * 128 * float((ke - ks).clamp(min=0).sum())
        emit(op="ragged", H=H, S=S, N=N, ms=ms, of_fp8=flops / ms / 1e9 / lim["fp8_tflops"], tflops=flops / ms / 1e9)
for B, h_q in ((128, 128), (128, 32)):
    a = decode_inputs(B, 1, h_q, 2048, dev)
    call = functools.partial(sparse_mla_decode_triton, a["q"], a["kv_cache"], a["indices"], a["sm_scale"])
    emit(op="decode_bf16mma", B=B, h_q=h_q, ms=bench_ms(call, graph=True))
