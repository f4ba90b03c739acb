"""Benchmark suite: ``nsa-backend bench`` (or ``python -m nsa_backend.bench``).

Every op family has a module ``nsa_backend/bench/<family>.py`` with

    run(quick: bool, limits: dict) -> list[dict]

returning one row per (op, shape, implementation)::

    {"family": str, "op": str, "shape": str | dict, "impl": str,
     "ms": float | None,       # median ms from nsa_backend.bench.timing.bench_ms
     "tflops": float | None,   # useful TFLOP/s
     "gbps": float | None,     # GB/s
     "ratios": {name: float}}  # optional extra ratios; the runner adds the standard ones

and optionally ``"limit"`` (the limit names bounding the row) and ``"note"`` (why ``ms`` is None).
``limits`` holds ``copy_gbps``, ``bf16_tflops`` and ``fp8_tflops`` measured in the same run
(any may be None). With ``quick=True`` a module runs tiny shapes, and on CPU only the reference
path. The runner (:mod:`nsa_backend.bench.runner`) does the rest: limits, ratios, environment,
``results.json`` / ``results.md`` / ``results.csv`` / plots.
"""

from __future__ import annotations

FAMILIES: tuple[str, ...] = ("indexer", "topk", "sparse_mla", "mhc", "v4", "eager", "peers")

__all__ = ["FAMILIES"]
