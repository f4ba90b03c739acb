"""Same-process sweeps under the mma.sync proxy with the forced arch's shared memory per SM (CUDA graph, two passes,
the second in reverse order, L2 evicted before each call):

<op> is one of:

- ``paged``: the 64-head, one-row paged logits tile of the 100 KiB parts (``PAGED_SMALL_TUNED[(64, 1)]``) with its
  chunks planned for other programs per SM (``r<n>``), register caps (``cap<n>``) and stages (``s<n>``);
- ``decode``: the 32-head fp8_ds_mla decode tile against 64-key tiles, stages, indices ahead and 8 warps, each with
  the top-k splits planned for 1-2 programs per SM (3 for the shipped tile);
- ``mhc``: the stacked-parts mHC GEMM with ``SQ_AHEAD`` off and on; needs ``mhc_sq_ahead.diff`` applied (the
  change was measured slower and is not in the tree).

    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=<arch> python sweeps.py <op> <arch> [names]

``names``: a comma-separated subset of the variants. One JSON line per measurement.
"""

import dataclasses
import functools
import json
import sys

import torch

from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import indexer as cfg_indexer
from nsa_backend.configs import mhc as cfg_mhc
from nsa_backend.configs.sparse_mla import AttnConfig, decode_num_splits
from nsa_backend.kernels import indexer as kernels_indexer
from nsa_backend.kernels import mhc as kernels_mhc
from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

PAGED_SHAPES = ((128, 8192), (128, 32768), (128, 65536), (64, 32768), (16, 8192), (8, 65536))
DECODE_SHAPES = ((128, 128), (128, 64), (32, 64), (128, 32))


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def pick(variants: dict, names: str | None) -> dict:
    return variants if names is None else {k: v for k, v in variants.items() if k in names.split(",")}


def passes(variants: dict):
    """Both passes over the variants, the second in reverse order."""
    for p in range(2):
        for item in (variants.items() if p == 0 else list(variants.items())[::-1]):
            yield p, item


def paged(arch: str, names: str | None, dev: torch.device) -> None:
    copy = copy_gbps(dev, 2 * 2**30)
    emit(op="copy", arch=arch, gbps=copy)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = cfg_indexer.paged_config(64, 1, 128, int(arch[2:]))
    emit(op="cfg", cfg=str(base))
    R = dataclasses.replace
    variants = pick({
        "r6": R(base, resident=6), "r5": R(base, resident=5), "r4": R(base, resident=4), "r3": R(base, resident=3),
        "r8": R(base, resident=8), "r5cap96": R(base, resident=5, max_regs=96),
        "r6cap80": R(base, resident=6, max_regs=80), "r6cap96": R(base, resident=6, max_regs=96),
        "r10cap96": R(base, resident=10, max_regs=96), "r4cap96": R(base, resident=4, max_regs=96),
        "r5cap96s2": R(base, resident=5, max_regs=96, num_stages=2),
        "r6cap80s2": R(base, resident=6, max_regs=80, num_stages=2),
        "r5cap96s4": R(base, resident=5, max_regs=96, num_stages=4),
    }, names)
    for B, length in PAGED_SHAPES:
        q, cache, w, ctx, table = paged_inputs(B, length, 1, 64, 128)
        first = None
        for p, (name, cfg) in passes(variants):
            call = functools.partial(kernels_indexer.fp8_paged_mqa_logits_triton, q, cache, w, ctx, table, None,
                                     length, config=cfg)
            out = call()
            first = out.clone() if first is None else first
            ms = bench_ms(call, graph=True)
            emit(op="paged", arch=arch, B=B, L=length, v=name, p=p, ms=ms,
                 chunk=cfg_indexer.paged_chunk(B, length, sms, cfg.block_n, cfg.resident),
                 of_copy=B * length * 132 / ms / 1e6 / copy, same_as_first=bool(torch.equal(out, first)))


def decode(arch: str, names: str | None, dev: torch.device) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    A = AttnConfig
    tiles = pick({
        "base": A(32, 32, 4, 1, reread_keys=True), "s2": A(32, 32, 4, 2, reread_keys=True),
        "s2ia": A(32, 32, 4, 2, idx_ahead=True, reread_keys=True),
        "s1ia": A(32, 32, 4, 1, idx_ahead=True, reread_keys=True),
        "n16s2ia": A(32, 16, 4, 2, idx_ahead=True, reread_keys=True),
        "n16s3ia": A(32, 16, 4, 3, idx_ahead=True, reread_keys=True),
        "n64s1": A(32, 64, 4, 1, reread_keys=True), "n64s1noreread": A(32, 64, 4, 1),
        "w8": A(32, 32, 8, 1, reread_keys=True), "w8s2ia": A(32, 32, 8, 2, idx_ahead=True, reread_keys=True),
        "n64w8": A(32, 64, 8, 1, reread_keys=True), "n64w8ia": A(32, 64, 8, 1, idx_ahead=True, reread_keys=True),
    }, names)
    for B, h_q in DECODE_SHAPES:
        a = decode_inputs(B, 1, h_q, 2048, dev)
        args = (a["q"], a["kv_cache"], a["indices"], a["sm_scale"])
        ref = sparse_mla_decode_triton(*args)[0].float()
        for p, (name, cfg) in passes(tiles):
            for per_sm in (1, 2, 3) if name == "base" else (1, 2):
                splits = decode_num_splits(B, -(-h_q // 32), 2048, cfg.block_n, sms, 32, per_sm)[0]

                call = functools.partial(sparse_mla_decode_triton, *args, config=cfg, num_splits=splits)
                err = (call()[0].float() - ref).abs().max().item()
                emit(op="decode", arch=arch, B=B, h_q=h_q, v=name, per_sm=per_sm, splits=splits, p=p,
                     ms=bench_ms(call, 10, 60, graph=True), err=err)


def mhc(arch: str, names: str | None, dev: torch.device) -> None:
    copy = copy_gbps(dev, 2 * 2**30)
    emit(op="copy", arch=arch, gbps=copy)
    N, K = 24, 28672
    for M in (1024, 2048, 4096, 8192, 16384):
        a = torch.randn(M, K, device=dev).to(torch.bfloat16)
        b = torch.randn(N, K, device=dev) / K**0.5
        ref = a.double() @ b.double().T
        sq_ref = a.double().pow(2).sum(-1)
        rms = ref.pow(2).mean().sqrt().item()
        d = torch.empty(M, N, device=dev)
        sq = torch.empty(M, device=dev)
        for p, (_, ahead) in passes({"off": False, "on": True}):
            cfg_mhc.SQ_AHEAD = ahead

            call = functools.partial(kernels_mhc.tf32_hc_prenorm_gemm_triton, a, b, d, sq)
            call()
            err = (d.double() - ref).abs().max().item() / rms
            sq_err = ((sq.double() - sq_ref).abs() / sq_ref).max().item()
            ms = bench_ms(call, 10, 60, graph=True)
            emit(op="mhc", arch=arch, M=M, sq_ahead=ahead, p=p, ms=ms, of_copy=a.numel() * 2 / ms / 1e6 / copy,
                 err=err, sq_rel=sq_err)


if __name__ == "__main__":
    what, arch = sys.argv[1], sys.argv[2]
    proxy.limit_shared_memory_per_sm(arch)
    {"paged": paged, "decode": decode, "mhc": mhc}[what](arch, sys.argv[3] if len(sys.argv) > 3 else None,
                                                         torch.device("cuda"))
