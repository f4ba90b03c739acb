"""Benchmark of ``topk_indices`` (top-2048) against ``torch.topk`` at the indexer's shapes.

- ragged (prefill) rows: ``S = 4096`` rows of ``N`` in {8K, 16K, 32K, 64K} columns with causal
  ends (row ``i`` sees ``[0, N - S + i]``), as produced by ``fp8_mqa_logits``;
- paged (decode) rows: ``B * next_n`` rows (``B = 128``, ``next_n`` in {1, 2}) of ``L`` in
  {4K, 8K, 16K, 32K, 64K} columns, row ends at each row's visible length.

``torch`` is ``torch.topk(logits, k).indices`` on rows whose columns outside the window hold
``-inf`` (what callers without a window-aware kernel run); its row carries
``ratios["triton_speedup"]`` = torch ms / Triton ms. ``gbps`` counts one read of the logits.
"""

from __future__ import annotations

from typing import Any

import torch

import nsa_backend as nb
from nsa_backend.bench.timing import bench_ms, gbps

FAMILY = "topk"
TOPK = 2048
WARMUP_MS, REP_MS = 10.0, 40.0


def _time(fn, graph: bool = False) -> tuple[float | None, str | None]:
    try:
        return bench_ms(fn, WARMUP_MS, REP_MS, graph=graph), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def _row(op, shape, impl, ms, nbytes, note=None, **ratios):
    row = {"family": FAMILY, "op": op, "shape": shape, "impl": impl, "ms": ms, "tflops": None,
           "gbps": gbps(nbytes, ms), "ratios": {k: v for k, v in ratios.items() if v is not None}}
    if note:
        row["note"] = note
    return row


def cases(quick: bool) -> list[tuple[str, int, int, int]]:
    """``(kind, rows, columns, next_n)``."""
    ragged = (8192,) if quick else (8192, 16384, 32768, 65536)
    paged = (4096,) if quick else (4096, 8192, 16384, 32768, 65536)
    out = [("ragged", 4096, n, 1) for n in ragged]
    out += [("paged", 128 * nn, n, nn) for nn in (1, 2) for n in paged]
    return out


def inputs(kind: str, R: int, N: int, next_n: int, device: str = "cuda"):
    logits = torch.randn(R, N, device=device)
    if kind == "ragged":
        ends = torch.arange(N - R + 1, N + 1, dtype=torch.int32, device=device)
    else:
        ends = (N - next_n + 1 + torch.arange(R, device=device) % next_n).int()
    cols = torch.arange(N, device=device)[None, :]
    logits.masked_fill_(cols >= ends[:, None].long(), float("-inf"))
    return logits, ends


def _case_rows(kind: str, R: int, N: int, next_n: int, copy_rate: float | None) -> list[dict[str, Any]]:
    shape = {"rows": R, "N": N, "topk": TOPK, "kind": kind, "next_n": next_n}
    logits, ends = inputs(kind, R, N, next_n)
    nbytes = float(logits.numel() * 4 + R * TOPK * 4)
    ms, note = _time(lambda: nb.topk_indices(logits, TOPK, None, ends, impl="triton"))
    rows = [_row("topk_indices", shape, "triton", ms, nbytes, note,
                 vs_copy=(nbytes / ms / 1e6 / copy_rate) if (ms and copy_rate) else None)]
    t_ms, t_note = _time(lambda: torch.topk(logits, TOPK, dim=1))
    rows.append(_row("topk_indices", shape, "torch", t_ms, nbytes, t_note,
                     triton_speedup=(t_ms / ms) if (t_ms and ms) else None))
    if kind == "paged":
        # Decode steps run as CUDA-graph replays in SGLang and vLLM; compare both captured.
        g_ms, g_note = _time(lambda: nb.topk_indices(logits, TOPK, None, ends, impl="triton"), graph=True)
        tg_ms, tg_note = _time(lambda: torch.topk(logits, TOPK, dim=1), graph=True)
        rows.append(_row("topk_indices", shape, "triton-graph", g_ms, nbytes, g_note,
                         vs_copy=(nbytes / g_ms / 1e6 / copy_rate) if (g_ms and copy_rate) else None))
        rows.append(_row("topk_indices", shape, "torch-graph", tg_ms, nbytes, tg_note,
                         triton_speedup=(tg_ms / g_ms) if (tg_ms and g_ms) else None))
    return rows


def run(quick: bool, limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """Benchmark rows (see the module docstring). Without CUDA: the built-in tiny reference case."""
    if not torch.cuda.is_available():
        from nsa_backend.bench import builtin

        return builtin.run(FAMILY, quick, limits)
    rows: list[dict[str, Any]] = []
    for kind, R, N, next_n in cases(quick):
        rows += _case_rows(kind, R, N, next_n, limits.get("copy_gbps"))
        torch.cuda.empty_cache()
    # logical -> global translation at decode shape
    B, M, page = 128, 1024, 64
    idx = torch.randint(-1, M * page, (B * 2, TOPK), dtype=torch.int32, device="cuda")
    table = torch.randint(0, 1 << 20, (B, M), dtype=torch.int32, device="cuda")
    req = torch.arange(B * 2, dtype=torch.int32, device="cuda") // 2
    shape = {"rows": B * 2, "topk": TOPK, "page": page}
    nbytes = float(idx.numel() * 8)
    ms, note = _time(lambda: nb.logical_to_global_indices(idx, table, req, page, impl="triton"))
    rows.append(_row("logical_to_global_indices", shape, "triton", ms, nbytes, note))
    r_ms, r_note = _time(lambda: nb.logical_to_global_indices(idx, table, req, page, impl="reference"))
    rows.append(_row("logical_to_global_indices", shape, "reference", r_ms, nbytes, r_note,
                     triton_speedup=(r_ms / ms) if (r_ms and ms) else None))
    return rows


def sweep(quick: bool = False) -> list[dict[str, Any]]:
    """Time candidate whole-row (``RowConfig``) and split-path (``TopkConfig``) launch configurations
    at one decode and one prefill shape (decode ones as CUDA-graph replays)."""
    from nsa_backend.configs.topk import RowConfig, TopkConfig
    from nsa_backend.kernels import topk as kt

    candidates = (RowConfig(2048, 8, 2, prefetch=True), RowConfig(2048, 8, 1, prefetch=True),
                  RowConfig(2048, 8, 2), RowConfig(4096, 16, 1, prefetch=True), TopkConfig(1024, 4),
                  TopkConfig(4096, 8))
    rows = []
    for kind, R, N, next_n in (("paged", 128, 65536, 1), ("ragged", 4096, 32768, 1)):
        logits, ends = inputs(kind, R, N, next_n)
        for cfg in candidates[::3] if quick else candidates:
            ms, note = _time(lambda cfg=cfg, a=(logits, TOPK, None, ends):
                             kt.topk_indices_triton(*a, config=cfg), graph=kind == "paged")
            rows.append(_row("topk_indices", {"rows": R, "N": N, "kind": kind}, f"triton[{cfg}]", ms,
                             float(logits.numel() * 4), note))
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m nsa_backend.bench.topk [--quick] [--sweep] [--out PREFIX]``: JSON + markdown."""
    from nsa_backend.bench.standalone import family_main

    family_main(__spec__.name if __spec__ else "nsa_backend.bench.topk", run, sweep, argv)


if __name__ == "__main__":
    main()
