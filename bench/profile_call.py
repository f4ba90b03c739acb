"""One call of a public op for a profiler, on the SM120 / SM8x route under the proxy or natively.

Warm-up calls compile the kernels; then one call runs between ``cudaProfilerStart`` and ``cudaProfilerStop``, so
that Nsight Compute with ``--profile-from-start off`` (or Nsight Systems with
``--capture-range=cudaProfilerApi``) sees exactly that call's kernels. The op runs with ``impl="triton"`` on the
benchmark suite's inputs (``nsa_backend.bench.sparse_mla`` / ``indexer``); ``--proxy ARCH`` sets the process up as
``nsa-backend bench --proxy ARCH`` does (the arch's routing and configurations, no warpgroup MMA, its shared memory
per SM) and ``--gluon 0`` takes the portable ``tl`` kernels where a Gluon kernel would run::

    python bench/profile_call.py prefill --h-q 128 --proxy sm120
    python bench/profile_call.py decode --b 128 --h-q 64 --kv bf16 --proxy sm120
    ncu --profile-from-start off --set full -o /tmp/prefill \\
        python bench/profile_call.py prefill --h-q 128 --proxy sm120

Exit status 0 after the profiled call, 2 for a usage error or a machine it cannot run on (one line, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

import nsa_backend as nb
from nsa_backend.bench import proxy
from nsa_backend.bench.indexer import paged_inputs
from nsa_backend.bench.sparse_mla import DECODE_SCALE_FORMAT, decode_inputs, prefill_inputs
from nsa_backend.kernels._arch import device_sms

OPS = ("prefill", "decode", "paged", "mhc")
# DeepSeek-V4's mHC pre-norm GEMM: N = hc_mult * (2 + hc_mult) = 24, K = hc_mult * hidden = 4 * 7168.
MHC_N, MHC_K = 24, 28672
KV_FORMATS = ("fp8", "bf16")


def positive_int(text: str) -> int:
    """An ``int`` of at least 1 (argparse reports the error with the option's name)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/profile_call.py",
                                description="One call of a public op between cudaProfilerStart and cudaProfilerStop.")
    p.add_argument("op", choices=OPS, help="flash_mla_sparse_fwd (prefill), sparse_mla_decode (decode), "
                                           "fp8_paged_mqa_logits (paged) or tf32_hc_prenorm_gemm (mhc)")
    p.add_argument("--b", type=positive_int, default=128, help="decode / paged: requests (default 128)")
    p.add_argument("--s-q", type=positive_int, default=None,
                   help="query rows: prefill 4096, decode 1 (the defaults)")
    p.add_argument("--h-q", type=positive_int, default=128, help="prefill / decode: query heads (default 128)")
    p.add_argument("--topk", type=positive_int, default=2048, help="prefill / decode: top-k (default 2048)")
    p.add_argument("--s-kv", type=positive_int, default=32768, help="prefill: keys (default 32768)")
    p.add_argument("--kv", choices=KV_FORMATS, default="fp8",
                   help="decode: the paged cache, fp8_ds_mla with power-of-two scales (fp8) or bf16")
    p.add_argument("--context", type=positive_int, default=32768,
                   help="paged: tokens per request, a multiple of 64 (default 32768)")
    p.add_argument("--next-n", type=positive_int, default=1, help="paged: query rows per request (default 1)")
    p.add_argument("--heads", type=positive_int, default=64, help="paged: indexer heads (default 64)")
    p.add_argument("--m", type=positive_int, default=4096, help="mhc: rows of a (default 4096)")
    p.add_argument("--proxy", default=None, metavar="ARCH",
                   help="time the route of an mma.sync arch on an sm_90 / sm_100 GPU (sm120, sm121, sm89, sm86, sm80)")
    p.add_argument("--gluon", choices=("0", "1"), default=None,
                   help="NSA_BACKEND_GLUON for the call: 0 takes the tl kernels (default: the environment's)")
    p.add_argument("--warmup", type=positive_int, default=3, help="calls before the profiled one (default 3)")
    return p


def check(args: argparse.Namespace) -> None:
    """Refuse what the ops would refuse later, naming the option (``ValueError``)."""
    if args.proxy is not None:
        proxy.check_arch(args.proxy)
    if args.op == "paged" and args.context % 64:
        raise ValueError(f"--context: expected a multiple of 64 (the cache's page), got {args.context}")
    if args.op == "prefill" and args.topk > args.s_kv:
        raise ValueError(f"--topk: expected at most --s-kv ({args.s_kv}), got {args.topk}")
    if args.op == "decode" and args.topk > 8192:
        raise ValueError(f"--topk: expected at most 8192 (the tokens of each request's context), got {args.topk}")


def bf16_cache(fp8_cache: torch.Tensor) -> torch.Tensor:
    """A random bf16 paged cache ``[num_blocks, page, 1, 576]`` with the slots of ``fp8_cache``."""
    num_blocks, page = fp8_cache.shape[:2]
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(num_blocks, page, 1, 576, generator=g).to(device=fp8_cache.device, dtype=torch.bfloat16)


def op_arguments(args: argparse.Namespace, device: torch.device) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The public op ``args`` names and its keyword arguments (the benchmark suite's inputs), without ``impl``."""
    if args.op == "prefill":
        return nb.flash_mla_sparse_fwd, prefill_inputs(args.s_q or 4096, args.s_kv, args.h_q, args.topk, device)
    if args.op == "decode":
        inputs = decode_inputs(args.b, args.s_q or 1, args.h_q, args.topk, device)
        if args.kv == "bf16":
            return nb.sparse_mla_decode, {**inputs, "kv_cache": bf16_cache(inputs["kv_cache"]), "kv_format": "bf16"}
        return nb.sparse_mla_decode, {**inputs, "kv_scale_format": DECODE_SCALE_FORMAT}
    if args.op == "paged":
        q, cache, w, ctx, table = paged_inputs(args.b, args.context, args.next_n, args.heads, 128,
                                               device=str(device))
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, device_sms(device, 8), impl="triton")
        return nb.fp8_paged_mqa_logits, dict(q=q, kv_cache=cache, weights=w, context_lens=ctx, block_table=table,
                                             schedule_meta=meta, max_context_len=args.context)
    return nb.tf32_hc_prenorm_gemm, dict(a=torch.randn(args.m, MHC_K, device=device).bfloat16(),
                                         b=torch.randn(MHC_N, MHC_K, device=device),
                                         d=torch.empty(args.m, MHC_N, device=device),
                                         sqr_sum=torch.empty(args.m, device=device))


def build_call(args: argparse.Namespace, device: torch.device) -> Callable[[], object]:
    """The op's call with ``impl="triton"`` on the benchmark suite's inputs for ``args``."""
    op, kwargs = op_arguments(args, device)
    return lambda: op(**kwargs, impl="triton")


def profile_once(call: Callable[[], object], warmup: int) -> None:
    """``warmup`` calls, then one between ``cudaProfilerStart`` and ``cudaProfilerStop``."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check(args)
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible: the call is profiled on a GPU")
        if args.gluon is not None:
            os.environ["NSA_BACKEND_GLUON"] = args.gluon
        if args.proxy is not None:
            proxy.enable(args.proxy, torch.cuda.get_device_capability())
    except ValueError as exc:
        print(f"profile_call.py: {exc}", file=sys.stderr)
        return 2
    profile_once(build_call(args, torch.device("cuda")), args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
