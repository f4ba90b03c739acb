"""Benchmark of sparse MLA prefill and decode: Triton kernels against FlashMLA and the reference.

Shapes (``quick=False``):

- prefill ``flash_mla_sparse_fwd``: ``s_q 4096``, ``s_kv 32768``, ``topk 2048``, ``d_qk 576``,
  ``h_q`` in {128, 64, 32, 16}. Useful FLOPs ``2 * s_q * h_q * topk * (d_qk + d_v)``.
- decode ``sparse_mla_decode`` over an "fp8_ds_mla" cache (page 64, 8192 tokens per request):
  ``B`` in {32, 128}, ``s_q`` in {1, 2}, ``topk 2048``, ``h_q`` in {128, 64, 32, 16}. Bytes: the gathered
  656-byte tokens plus ``q`` and ``out``; ``gbps`` is reported next to the measured copy bandwidth.
  The cache is written with power-of-two scales (``DECODE_SCALE_FORMAT``, DeepSeek's writers), and our
  rows pass that as ``kv_scale_format``, as the SGLang integration does for DeepSeek models.

Prefill also times ``gather_kv``: a pure read of the same ``topk`` rows of 1152 bytes per query row
(:func:`gather_kv_rows`, no arithmetic), timed the same way. No prefill kernel that reads every
gathered row once can be faster, so ``vs_gather_kv`` of the Triton row (the read's time over the
row's) is its share of the attainable speed; ``gbps`` counts the gathered bytes only.

FlashMLA (``flash_mla`` package, ``use_legacy=True`` where it takes that argument) accepts
``h_q`` 64 or 128 only; smaller head counts are run padded to 64 heads, as frameworks do, and the
row is named ``flash_mla_pad64``. ``ratios["vs_flash_mla"]`` is FlashMLA's time over ours (> 1:
ours is faster). The reference runs only in quick mode (it is far slower).

Decode also times two rows of the same Triton kernel whose keys cost nothing to fetch (``tile_hot_fp8``,
``tile_hot_bf16``): every row's top-k cycles over the ``HOT_SLOTS`` tokens of one page, which stay in
the L1 / L2 caches, of the fp8 cache or of a bf16 cache. They time the attention tile alone (its
MMAs, softmax, shared-memory traffic and, for fp8, the e4m3 conversion) at the same shape, so the
Triton row's ``vs_tile_hot_*`` says how much of its time the key gather takes; ``of_bf16_mm`` of a hot
row is the tile's own share of the matmul rate.

Decode also times the public op ``nsa_backend.sparse_mla_decode`` with ``impl="auto"`` (row
``auto``, its note names the route): what a framework integration gets, argument checks, routing,
native wrappers and every launch included (in a CUDA graph, so only the GPU side counts).

Run alone: ``python -m nsa_backend.bench.sparse_mla [--quick] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from nsa_backend.bench import proxy
from nsa_backend.bench.timing import bench_ms, gbps, tflops

FAMILY = "sparse_mla"
D_QK = 576
D_V = 512
PAGE = 64
TOKENS_PER_REQUEST = 8192
# scale format of the decode cache (power-of-two scales, as DeepSeek writes them)
DECODE_SCALE_FORMAT = "pow2"


def _flash_mla(host_only: bool = False) -> Any | None:
    """The ``flash_mla`` module, or ``None`` where it does not import. Under the proxy only with ``host_only``
    (host-time measurements, which do not depend on the chip)."""
    # the proxied arch has no FlashMLA; its sm_90 kernels would time the wrong chip
    if proxy.active() and not host_only:
        return None
    try:
        import flash_mla
    except Exception:
        return None
    return flash_mla


def _legacy(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return {"use_legacy": True} if "use_legacy" in inspect.signature(fn).parameters else {}
    except (TypeError, ValueError):
        return {}


def _row(
    op: str,
    shape: dict[str, Any],
    impl: str,
    ms: float | None,
    flops: float | None,
    nbytes: float | None,
    ratios: dict[str, float | None] | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    return {
        "family": FAMILY,
        "op": op,
        "shape": shape,
        "impl": impl,
        "ms": ms,
        "tflops": tflops(flops, ms),
        "gbps": gbps(nbytes, ms),
        "ratios": ratios or {},
        "note": note,
    }


def _safe_ms(
    fn: Callable[[], Any], device: torch.device, graph: bool = False
) -> tuple[float | None, str | None]:
    try:
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        return bench_ms(fn, device=device, graph=graph and device.type == "cuda"), None
    except Exception as e:  # a baseline that fails is reported, not fatal
        return None, f"{type(e).__name__}: {str(e)[:200]}"


@triton.jit
def _gather_kv_rows_kernel(kv_ptr, idx_ptr, out_ptr, topk, s_kv, stride_idx_row, stride_kv,
                           D_WORDS: tl.constexpr, D_ROPE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program reads the rows of one query row's index list as int32 words (576 bf16 = 256 + 32
    # words), BLOCK_N rows at a time, and folds them into one word; invalid indices are skipped.
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    o_w = tl.arange(0, D_WORDS)
    o_r = tl.arange(0, D_ROPE_WORDS)
    p_idx = idx_ptr + i_r * stride_idx_row
    b_acc = tl.zeros([BLOCK_N, D_WORDS], dtype=tl.int32)
    b_accr = tl.zeros([BLOCK_N, D_ROPE_WORDS], dtype=tl.int32)
    # the indices of a tile are read one tile ahead
    b_nx = tl.load(p_idx + o_n, mask=o_n < topk, other=-1)
    for n0 in range(0, topk, BLOCK_N):
        b_idx = b_nx
        b_nx = tl.load(p_idx + (n0 + BLOCK_N) + o_n, mask=n0 + BLOCK_N + o_n < topk, other=-1)
        m_n = (b_idx >= 0) & (b_idx < s_kv)
        p_row = kv_ptr + tl.where(m_n, b_idx, 0).to(tl.int64) * stride_kv
        b_acc ^= tl.load(p_row[:, None] + o_w[None, :], mask=m_n[:, None], other=0)
        b_accr ^= tl.load(p_row[:, None] + D_WORDS + o_r[None, :], mask=m_n[:, None], other=0)
    b_w = tl.xor_sum(tl.xor_sum(b_acc, axis=1), axis=0) ^ tl.xor_sum(tl.xor_sum(b_accr, axis=1), axis=0)
    tl.store(out_ptr + i_r, b_w)


# Tile of the gather floor (the fastest of the H200 sweep in bench/results/h200/tuning/
# sparse_mla_prefill_fewhead.md).
GATHER_BLOCK_N = 32
GATHER_NUM_WARPS = 4


def gather_kv_rows(kv: torch.Tensor, indices: torch.Tensor, block_n: int = GATHER_BLOCK_N,
                   num_warps: int = GATHER_NUM_WARPS) -> torch.Tensor:
    """Pure read of the rows ``indices`` (``[s_q, 1, topk]`` i32) of ``kv`` (``[s_kv, 1, 576]`` bf16):
    one int32 per query row (the xor of every word read), the floor of a sparse prefill."""
    s_q, topk = indices.shape[0], indices.shape[-1]
    s_kv = kv.shape[0]
    words = kv.view(s_kv, -1).view(torch.int32)
    idx = indices.view(s_q, topk)
    out = torch.empty(s_q, dtype=torch.int32, device=kv.device)
    if s_q:
        _gather_kv_rows_kernel[(s_q,)](words, idx, out, topk, s_kv, idx.stride(0), words.stride(0),
                                       D_WORDS=256, D_ROPE_WORDS=words.shape[1] - 256, BLOCK_N=block_n,
                                       num_warps=num_warps)
    return out


def prefill_inputs(s_q: int, s_kv: int, h_q: int, topk: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(s_q, h_q, D_QK, generator=g).to(device=device, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, D_QK, generator=g).to(device=device, dtype=torch.bfloat16)
    idx = torch.rand(s_q, s_kv, device=device).argsort(dim=1)[:, :topk].to(torch.int32).view(s_q, 1, topk)
    return dict(q=q, kv=kv, indices=idx, sm_scale=D_QK**-0.5)


def decode_inputs(B: int, s_q: int, h_q: int, topk: int, device: torch.device) -> dict[str, Any]:
    from nsa_backend.reference import pack_fp8_ds_mla

    g = torch.Generator(device="cpu").manual_seed(0)
    n_tok = B * TOKENS_PER_REQUEST
    num_blocks = n_tok // PAGE
    kv = torch.randn(n_tok, D_QK, generator=g).to(device=device, dtype=torch.bfloat16)
    cache = pack_fp8_ds_mla(kv, DECODE_SCALE_FORMAT).view(num_blocks, PAGE, 1, 656)
    del kv
    # Request b owns a random set of pages; its top-k are random distinct positions of its context.
    perm = torch.randperm(num_blocks, generator=g).to(device).view(B, -1)  # [B, pages per request]
    pos = torch.rand(B * s_q, TOKENS_PER_REQUEST, device=device).argsort(dim=1)[:, :topk].view(B, s_q, topk)
    page = torch.gather(perm, 1, (pos // PAGE).view(B, -1)).view(B, s_q, topk)
    idx = (page * PAGE + pos % PAGE).to(torch.int32)
    q = torch.randn(B, s_q, h_q, D_QK, generator=g).to(device=device, dtype=torch.bfloat16)
    return dict(q=q, kv_cache=cache, indices=idx, sm_scale=D_QK**-0.5)


# Tokens the hot-key rows cycle over: one page, small enough to stay in L1 / L2.
HOT_SLOTS = PAGE


def hot_key_inputs(a: dict[str, Any], kv_format: str) -> dict[str, Any]:
    """Decode arguments like ``a`` (from :func:`decode_inputs`) whose every top-k list cycles over the
    ``HOT_SLOTS`` tokens of one page: of ``a``'s fp8 cache, or of a one-page bf16 cache."""
    B, s_q, topk = a["indices"].shape
    device = a["q"].device
    idx = (torch.arange(topk, device=device, dtype=torch.int32) % HOT_SLOTS).expand(B, s_q, topk).contiguous()
    if kv_format == "fp8_ds_mla":
        cache = a["kv_cache"]
    else:
        g = torch.Generator(device="cpu").manual_seed(1)
        cache = torch.randn(1, PAGE, 1, D_QK, generator=g).to(device=device, dtype=torch.bfloat16)
    return dict(q=a["q"], kv_cache=cache, indices=idx, sm_scale=a["sm_scale"], kv_format=kv_format)


def _pad_heads(x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    if x.shape[dim] >= target:
        return x
    shape = list(x.shape)
    shape[dim] = target - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()


def _flash_mla_with_q(
    q: torch.Tensor, head_dim: int, h_q: int, device: torch.device
) -> tuple[Any, torch.Tensor, str] | None:
    """``(flash_mla, q padded to the 64 or 128 heads FlashMLA takes, row name)``; ``None`` when FlashMLA
    does not import or the device is not CUDA."""
    fm = _flash_mla()
    if fm is None or device.type != "cuda":
        return None
    target = 64 if h_q <= 64 else 128
    name = "flash_mla" if target == h_q else f"flash_mla_pad{target}"
    return fm, _pad_heads(q, head_dim, target), name


def bench_prefill(
    h_q: int,
    s_q: int,
    s_kv: int,
    topk: int,
    device: torch.device,
    with_reference: bool,
) -> list[dict[str, Any]]:
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

    a = prefill_inputs(s_q, s_kv, h_q, topk, device)
    shape = {"s_q": s_q, "s_kv": s_kv, "h_q": h_q, "topk": topk, "d_qk": D_QK, "d_v": D_V}
    flops = 2.0 * s_q * h_q * topk * (D_QK + D_V)
    nbytes = s_q * topk * D_QK * 2.0 + a["q"].numel() * 2 + s_q * h_q * D_V * 2
    rows = []
    ours, note = _safe_ms(
        lambda: flash_mla_sparse_fwd_triton(a["q"], a["kv"], a["indices"], a["sm_scale"]), device
    )
    fm_ms = None
    flash = _flash_mla_with_q(a["q"], 1, h_q, device)
    if flash is not None:
        fm, qp, name = flash
        kw = _legacy(fm.flash_mla_sparse_fwd)
        fm_ms, fm_note = _safe_ms(
            lambda: fm.flash_mla_sparse_fwd(qp, a["kv"], a["indices"], a["sm_scale"], D_V, **kw), device
        )
        rows.append(_row("flash_mla_sparse_fwd", shape, name, fm_ms, flops, nbytes, note=fm_note))
    ratio = fm_ms / ours if (fm_ms and ours) else None
    gather_bytes = s_q * topk * D_QK * 2.0
    g_ms, g_note = _safe_ms(lambda: gather_kv_rows(a["kv"], a["indices"]), device)
    rows.append(_row("flash_mla_sparse_fwd", shape, "gather_kv", g_ms, None, gather_bytes, note=g_note))
    ratios = {"vs_flash_mla": ratio, "vs_gather_kv": g_ms / ours if (g_ms and ours) else None}
    rows.insert(0, _row("flash_mla_sparse_fwd", shape, "triton", ours, flops, nbytes, ratios, note))
    if with_reference:
        from nsa_backend.reference import flash_mla_sparse_fwd as ref

        ms, note = _safe_ms(lambda: ref(a["q"], a["kv"], a["indices"], a["sm_scale"]), device)
        rows.append(_row("flash_mla_sparse_fwd", shape, "reference", ms, flops, nbytes, note=note))
    return rows


def bench_decode(
    B: int, s_q: int, h_q: int, topk: int, device: torch.device, copy_gbps: float | None, with_reference: bool
) -> list[dict[str, Any]]:
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

    a = decode_inputs(B, s_q, h_q, topk, device)
    shape = {"B": B, "s_q": s_q, "h_q": h_q, "topk": topk, "kv_format": "fp8_ds_mla", "page_size": PAGE}
    flops = 2.0 * B * s_q * h_q * topk * (D_QK + D_V)
    nbytes = B * s_q * topk * 656.0 + a["q"].numel() * 2 + B * s_q * h_q * D_V * 2
    rows = []
    ours, note = _safe_ms(
        lambda: sparse_mla_decode_triton(a["q"], a["kv_cache"], a["indices"], a["sm_scale"],
                                         kv_scale_format=DECODE_SCALE_FORMAT), device, graph=True
    )
    fm_ms = None
    flash = _flash_mla_with_q(a["q"], 2, h_q, device)
    if flash is not None:
        fm, qp, name = flash
        sched, _ = fm.get_mla_metadata()
        kw = _legacy(fm.flash_mla_with_kvcache)

        def run_fm():
            return fm.flash_mla_with_kvcache(
                qp,
                a["kv_cache"],
                None,
                None,
                D_V,
                sched,
                None,
                softmax_scale=a["sm_scale"],
                causal=False,
                is_fp8_kvcache=True,
                indices=a["indices"],
                **kw,
            )

        fm_ms, fm_note = _safe_ms(run_fm, device, graph=True)
        g = gbps(nbytes, fm_ms)
        rows.append(
            _row(
                "sparse_mla_decode",
                shape,
                name,
                fm_ms,
                flops,
                nbytes,
                {"of_copy_bw": g / copy_gbps if (g and copy_gbps) else None},
                note=fm_note,
            )
        )
    # what a framework gets: the public op with impl="auto" (the route, wrappers and launches included)
    from nsa_backend import sparse_mla_decode as public_decode
    from nsa_backend.routing.router import select_impl

    route = select_impl("sparse_mla_decode", "auto", {
        "device": device, "num_heads": h_q, "d_qk": D_QK, "topk": topk, "s_q": s_q, "kv_format": "fp8_ds_mla",
        "page_size": PAGE})
    auto_ms, auto_note = _safe_ms(
        lambda: public_decode(a["q"], a["kv_cache"], a["indices"], a["sm_scale"], kv_scale_format=DECODE_SCALE_FORMAT),
        device, graph=True
    )
    g = gbps(nbytes, auto_ms)
    rows.append(_row("sparse_mla_decode", shape, "auto", auto_ms, flops, nbytes,
                     {"of_copy_bw": g / copy_gbps if (g and copy_gbps) else None},
                     note=auto_note or f"public op, impl='auto': {route}"))
    g = gbps(nbytes, ours)
    rows.insert(
        0,
        _row(
            "sparse_mla_decode",
            shape,
            "triton",
            ours,
            flops,
            nbytes,
            {
                "vs_flash_mla": fm_ms / ours if (fm_ms and ours) else None,
                "of_copy_bw": g / copy_gbps if (g and copy_gbps) else None,
            },
            note,
        ),
    )
    # the attention tile alone: keys from one hot page, no DRAM traffic for them
    for fmt, impl in (("fp8_ds_mla", "tile_hot_fp8"), ("bf16", "tile_hot_bf16")):
        hot = hot_key_inputs(a, fmt)
        extra = {"kv_scale_format": DECODE_SCALE_FORMAT} if fmt == "fp8_ds_mla" else {}
        ms, h_note = _safe_ms(lambda hot=hot, extra=extra: sparse_mla_decode_triton(**hot, **extra), device,
                              graph=True)
        rows.append(_row("sparse_mla_decode", shape, impl, ms, flops, None, note=h_note))
    if with_reference:
        from nsa_backend.reference import sparse_mla_decode as ref

        ms, note = _safe_ms(lambda: ref(a["q"], a["kv_cache"], a["indices"], a["sm_scale"]), device)
        rows.append(_row("sparse_mla_decode", shape, "reference", ms, flops, nbytes, note=note))
    return rows


def run(quick: bool, limits: dict[str, Any]) -> list[dict[str, Any]]:
    """Benchmark rows (see the module docstring); ``limits`` gives ``copy_gbps`` for the decode ratio."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy = limits.get("copy_gbps")
    rows: list[dict[str, Any]] = []
    if device.type != "cuda":
        # The CPU interpreter: tiny shapes that only exercise the harness.
        rows += bench_prefill(16, 4, 256, 64, device, True)
        rows += bench_decode(1, 1, 16, 64, device, copy, True)
        return rows
    if quick:
        for h in (128, 16):
            rows += bench_prefill(h, 1024, 8192, 2048, device, True)
        for h in (128, 16):
            rows += bench_decode(32, 1, h, 2048, device, copy, False)
        return rows
    for h in (128, 64, 32, 16):
        rows += bench_prefill(h, 4096, 32768, 2048, device, False)
        torch.cuda.empty_cache()
    for B in (32, 128):
        for s_q in (1, 2):
            for h in (128, 64, 32, 16):
                rows += bench_decode(B, s_q, h, 2048, device, copy, False)
                torch.cuda.empty_cache()
    return rows


def to_markdown(rows: list[dict[str, Any]], limits: dict[str, Any], command: str) -> str:
    lines = [
        f"# sparse_mla benchmark\n\nCommand: `{command}`\n",
        f"Limits measured in the same run: {json.dumps(limits)}\n",
        "| op | shape | impl | ms | TFLOP/s | GB/s | ratios | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = (
            ", ".join(f"{k}={v}" for k, v in r["shape"].items())
            if isinstance(r["shape"], dict)
            else r["shape"]
        )

        def f(v, p=3):
            return (
                "" if v is None else (f"{v:.{p}f}" if isinstance(v, float) and math.isfinite(v) else str(v))
            )

        ratios = ", ".join(f"{k}={f(v, 2)}" for k, v in r["ratios"].items())
        lines.append(
            f"| {r['op']} | {shape} | {r['impl']} | {f(r['ms'], 4)} | {f(r['tflops'], 1)} | "
            f"{f(r['gbps'], 0)} | {ratios} | {r.get('note') or ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from nsa_backend.bench.limits import measure_limits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="write rows as JSON here (and a .md beside it)")
    p.add_argument("--command", default=None, help="command line recorded in the output")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    limits = measure_limits(device, args.quick)
    rows = run(args.quick, limits)
    command = args.command or " ".join(
        ["python", "-m", "nsa_backend.bench.sparse_mla", *(argv or sys.argv[1:])]
    )
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    fm = _flash_mla()
    env["flash_mla"] = getattr(fm, "__version__", None) if fm is not None else None
    result = {
        "family": FAMILY,
        "command": command,
        "quick": args.quick,
        "environment": env,
        "limits": limits,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(to_markdown(rows, limits, command))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as fh:
            fh.write(to_markdown(rows, limits, command))


if __name__ == "__main__":
    main()
