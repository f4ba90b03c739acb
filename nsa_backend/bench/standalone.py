"""``python -m nsa_backend.bench.<family>``: one family on its own, plus its launch-config sweep.

The suite (``nsa-backend bench``) is the normal entry point; this runs a single family module's
``run`` (or ``sweep``) and writes ``PREFIX.json`` and ``PREFIX.md`` in the same format as the
per-family files of ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rows = list[dict[str, Any]]


def to_markdown(rows: Rows, limits: dict[str, float | None]) -> str:
    """A markdown table of benchmark rows (and the limits they are compared with)."""
    lim = ", ".join(f"{k} = {v:.0f}" for k, v in limits.items() if v)
    lines = [f"Limits measured in the same run: {lim}", "",
             "| op | shape | impl | ms | TFLOP/s | GB/s | ratios |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["shape"]
        if isinstance(shape, dict):
            shape = ", ".join(f"{k}={v}" for k, v in shape.items())
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items())
        cells = [r["op"], shape, r["impl"], f"{r['ms']:.4f}" if r["ms"] else r.get("note", "-"),
                 f"{r['tflops']:.0f}" if r["tflops"] else "", f"{r['gbps']:.0f}" if r["gbps"] else "", ratios]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def family_main(module: str, run: Callable[[bool, dict], Rows], sweep: Callable[[bool], Rows] | None = None,
                argv: Sequence[str] | None = None) -> None:
    """Command line of one family module: ``[--quick] [--sweep] [--out PREFIX]``."""
    from nsa_backend.bench.limits import measure_limits

    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--quick", action="store_true")
    if sweep is not None:
        parser.add_argument("--sweep", action="store_true", help="time candidate launch configurations instead")
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    limits = measure_limits("cuda", args.quick)
    rows = sweep(args.quick) if getattr(args, "sweep", False) else run(args.quick, limits)
    text = to_markdown(rows, limits)
    print(text)
    if not args.out:
        return
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    cli = sys.argv[1:] if argv is None else list(argv)
    doc = {"command": f"python -m {module} " + " ".join(cli), "environment": env, "limits": limits, "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"`{doc['command']}` on {env['gpu']} (torch {env['torch']}, triton {env.get('triton')})\n\n")
        f.write(text)
