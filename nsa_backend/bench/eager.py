"""Host time of one eager call of each public op, against a direct FlashMLA call.

Outside a CUDA graph (every prefill, ``--enforce-eager``, any op a framework does not capture)
each call pays its Python work: argument checks, routing, allocation, the launch itself. This
family measures that cost: the CPU time from the call to its return, with the GPU idle at the call
(synchronised before every call, so a queue never hides or adds to it), median of ``CALLS`` calls
after a warm-up that compiles the kernels.

Rows: ``impl="host"`` is the public op (``impl="triton"``, the path SM120 / SM8x take, so the
native wrappers' own cost does not mix in); ``impl="host-auto"`` the same call with ``impl="auto"``.
The anchors: ``flash_mla`` rows time a direct call of FlashMLA's sparse decode
(``flash_mla_with_kvcache``) and of its ``get_mla_metadata`` where the package loads, and
``triton_empty_launch`` the launch of an empty Triton kernel, the floor of any Triton op.
``ratios["over_flash_mla"]`` is the row's host time over the FlashMLA decode call's (the target of
the decode-path ops is at most 1.5).

The ``ms`` column holds host milliseconds, not GPU time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

import nsa_backend as nb
from nsa_backend.bench import indexer as bench_indexer
from nsa_backend.bench import sparse_mla as bench_sparse_mla
from nsa_backend.bench import topk as bench_topk

CALLS = 300
QUICK_CALLS = 20
TOPK = 2048


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def host_ms(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Median CPU milliseconds from calling ``fn`` to its return, the device idle at every call."""
    cuda = device.type == "cuda"
    fn()  # compile and cache outside the timing
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(calls):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e3


def _cases(device: torch.device, quick: bool) -> dict[str, tuple[dict[str, Any], Callable[[str], Any]]]:
    """``op -> (shape, call(impl))`` at decode-step sizes (small when quick or off CUDA)."""
    small = quick or device.type != "cuda"
    B, L, H, D = (2, 256, 4, 128) if small else (32, 8192, 64, 128)
    dev = str(device)
    q, cache, w, ctx, table = bench_indexer.paged_inputs(B, L, 1, H, D, device=dev)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    meta = nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl="reference")
    topk = min(TOPK, L // 2)
    logits, ends = bench_topk.inputs("paged", B, L, 1, device=dev)
    h_q = 4 if small else 64
    decode = bench_sparse_mla.decode_inputs(B, 1, h_q, topk, device) if not small else _small_decode(device, h_q)
    dq = decode["q"]
    kv_rows = torch.randn(B, 576, device=device, dtype=torch.bfloat16)
    slots = torch.arange(B, device=device, dtype=torch.int64) * 3
    ds_cache = torch.zeros(B * 4, 656, dtype=torch.uint8, device=device).view(-1, 64 if not small else 1, 1, 656)
    rq, rkv, rw, rks, rke = bench_indexer.ragged_inputs(16 * B, L, H, D, device=dev)
    pq = torch.randn(16 * B, h_q, 576, device=device, dtype=torch.bfloat16)
    pkv = torch.randn(L, 1, 576, device=device, dtype=torch.bfloat16)
    pidx = torch.randint(0, L, (16 * B, 1, topk), device=device, dtype=torch.int32)
    m, n_hc, k_hc = (B, 24, 7168 if not small else 256)
    a = torch.randn(m, k_hc, device=device, dtype=torch.bfloat16)
    b = torch.randn(n_hc, k_hc, device=device, dtype=torch.float32)
    d = torch.empty(m, n_hc, device=device, dtype=torch.float32)
    sq = torch.empty(m, device=device, dtype=torch.float32)
    return {
        "get_paged_mqa_logits_metadata": ({"B": B, "num_sms": sms},
                                          lambda impl: nb.get_paged_mqa_logits_metadata(ctx, 64, sms, impl=impl)),
        "fp8_paged_mqa_logits": ({"B": B, "context": L, "H": H, "next_n": 1},
                                 lambda impl: nb.fp8_paged_mqa_logits(q, cache, w, ctx, table, meta, L, impl=impl)),
        "topk_indices": ({"rows": B, "N": L, "topk": topk},
                         lambda impl: nb.topk_indices(logits, topk, None, ends, impl=impl)),
        "sparse_mla_decode": ({"B": B, "s_q": 1, "h_q": h_q, "topk": topk},
                              lambda impl: nb.sparse_mla_decode(dq, decode["kv_cache"], decode["indices"],
                                                                decode["sm_scale"], kv_scale_format="pow2",
                                                                impl=impl)),
        "write_fp8_ds_mla_cache": ({"tokens": B},
                                   lambda impl: nb.write_fp8_ds_mla_cache(kv_rows, ds_cache, slots, impl=impl)),
        "fp8_mqa_logits": ({"S": 16 * B, "N": L, "H": H},
                           lambda impl: nb.fp8_mqa_logits(rq, rkv, rw, rks, rke, impl=impl)),
        "flash_mla_sparse_fwd": ({"s_q": 16 * B, "h_q": h_q, "topk": topk},
                                 lambda impl: nb.flash_mla_sparse_fwd(pq, pkv, pidx, 576**-0.5, impl=impl)),
        "tf32_hc_prenorm_gemm": ({"M": m, "N": n_hc, "K": k_hc},
                                 lambda impl: nb.tf32_hc_prenorm_gemm(a, b, d, sq, impl=impl)),
    }


def _small_decode(device: torch.device, h_q: int) -> dict[str, Any]:
    kv = torch.randn(64, 576, device=device, dtype=torch.bfloat16)
    cache = nb.pack_fp8_ds_mla(kv, "pow2", impl="reference").view(1, 64, 1, 656)
    return {"q": torch.randn(2, 1, h_q, 576, device=device, dtype=torch.bfloat16), "kv_cache": cache,
            "indices": torch.randint(0, 64, (2, 1, 32), device=device, dtype=torch.int32), "sm_scale": 576**-0.5}


def _flash_mla_anchor(device: torch.device, calls: int) -> dict[str, float]:
    """Host ms of FlashMLA's sparse decode and metadata calls at the 64-head decode shape; {} without FlashMLA."""
    # Host time only: the anchor is timed under the proxy too (its CPU work does not depend on the chip).
    fm = bench_sparse_mla._flash_mla(host_only=True)
    if fm is None or device.type != "cuda":
        return {}
    a = bench_sparse_mla.decode_inputs(32, 1, 64, TOPK, device)
    sched, _ = fm.get_mla_metadata()
    kw = bench_sparse_mla._legacy(fm.flash_mla_with_kvcache)

    def decode() -> Any:
        return fm.flash_mla_with_kvcache(a["q"], a["kv_cache"], None, None, 512, sched, None,
                                         softmax_scale=a["sm_scale"], causal=False, is_fp8_kvcache=True,
                                         indices=a["indices"], **kw)

    return {"flash_mla_with_kvcache": host_ms(decode, calls, device),
            "get_mla_metadata": host_ms(lambda: fm.get_mla_metadata(), calls, device)}


def run(quick: bool, limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """Host-time rows of every public op listed in :func:`_cases`, and the anchors."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls = QUICK_CALLS if quick or device.type != "cuda" else CALLS
    anchors = _flash_mla_anchor(device, calls)
    anchor = anchors.get("flash_mla_with_kvcache")
    rows: list[dict[str, Any]] = []

    def row(op: str, shape: Any, impl: str, ms: float | None, note: str | None = None) -> dict[str, Any]:
        over = (ms / anchor) if (ms and anchor) else None
        return {"op": op, "shape": shape, "impl": impl, "ms": ms, "ratios": {"over_flash_mla": over}, "note": note}

    for name, ms in anchors.items():
        rows.append(row(name, {"B": 32, "h_q": 64, "topk": TOPK}, "flash_mla", ms))
    if device.type == "cuda":
        x = torch.empty(16, device=device)
        rows.append(row("empty_kernel", {}, "triton_empty_launch",
                        host_ms(lambda: _empty_kernel[(1,)](x, 16, BLOCK=16), calls, device)))
    impls = ("triton", "auto") if device.type == "cuda" else ("reference",)
    for op, (shape, call) in _cases(device, quick).items():
        for impl in impls:
            label = "host" if impl != "auto" else "host-auto"
            try:
                ms = host_ms(lambda c=call, i=impl: c(i), calls, device)
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
                rows.append(row(op, shape, label, None, f"{type(exc).__name__}: {exc}"[:300]))
                continue
            rows.append(row(op, shape, label, ms))
    return rows
