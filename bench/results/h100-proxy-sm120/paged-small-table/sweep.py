"""Chunk plans and launches of the 100 KiB parts' paged logits entries, same process, under the mma.sync proxy
with the forced arch's shared memory per SM (CUDA graph, two passes, the second in reverse order, L2 evicted
before each call):

    DISABLE_MMA_V3=1 NSA_BACKEND_GLUON=0 NSA_BACKEND_FORCE_ARCH=<arch> python sweep.py <arch> <entries> <residents>

``entries``: comma-separated ``<heads>x<next_n>`` (e.g. ``64x2,32x1``); ``residents``: the programs per SM the
chunks are planned for (e.g. ``3,4,5``). With sm_120 the variants ``r<n>`` are its ``PAGED_SMALL_TUNED`` entry;
with another arch ``r<n>`` is the launch of ``PAGED_CONFIGS`` (that arch's table before the entries served it) and
``t120r<n>`` the entry. Each result is compared with the first variant's on the same inputs (``diff`` against
``scale``, the largest finite logit). One JSON line per measurement.
"""

import dataclasses
import functools
import json
import sys

import torch

from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.timing import bench_ms
from nsa_backend.configs import indexer as ci
from nsa_backend.kernels import indexer as ki

SHAPES = ((128, 8192), (128, 32768), (128, 65536), (64, 32768), (16, 8192), (8, 65536))


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def table_config(heads: int, next_n: int, arch: int) -> ci.LogitsConfig:
    """The launch ``paged_config`` returns without the tuned entries."""
    saved = dict(ci.PAGED_SMALL_TUNED)
    ci.PAGED_SMALL_TUNED.clear()
    try:
        return ci.paged_config(heads, next_n, 128, arch)
    finally:
        ci.PAGED_SMALL_TUNED.update(saved)


def main(arch: str, entries: str, residents: list[int]) -> None:
    dev = torch.device("cuda")
    proxy.limit_shared_memory_per_sm(arch)
    copy = copy_gbps(dev, 2 * 2**30)
    emit(op="copy", arch=arch, gbps=copy)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    number = int(arch[2:])
    for entry in entries.split(","):
        heads, next_n = map(int, entry.split("x"))
        tuned = ci.paged_config(heads, next_n, 128, number)
        base = tuned if arch == "sm120" else table_config(heads, next_n, number)
        emit(op="cfg", arch=arch, H=heads, next_n=next_n, cfg=str(base))
        variants = {f"r{r}": dataclasses.replace(base, resident=r) for r in residents}
        if base != tuned:
            variants.update({f"t120r{r}": dataclasses.replace(tuned, resident=r) for r in residents})
        for B, length in SHAPES:
            q, cache, w, ctx, table = paged_inputs(B, length, next_n, heads, 128)
            first = None
            for p in range(2):
                for name, cfg in (list(variants.items()) if p == 0 else list(variants.items())[::-1]):
                    call = functools.partial(ki.fp8_paged_mqa_logits_triton, q, cache, w, ctx, table, None, length,
                                             config=cfg)
                    out = call()
                    first = out.clone() if first is None else first
                    finite = torch.isfinite(first)
                    diff = (out - first)[finite].abs().max().item() if finite.any() else 0.0
                    scale = first[finite].abs().max().item() if finite.any() else 0.0
                    ms = bench_ms(call, graph=True)
                    emit(op="paged", arch=arch, H=heads, next_n=next_n, B=B, L=length, v=name, base_r=base.resident,
                         p=p, ms=ms, chunk=ci.paged_chunk(B, length, sms, cfg.block_n, cfg.resident),
                         of_copy=B * length * 132 / ms / 1e6 / copy, same=bool(torch.equal(out, first)), diff=diff,
                         scale=scale, inf_same=bool(torch.equal(torch.isfinite(out), finite)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")])
