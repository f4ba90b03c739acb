"""The markdown table of ``sweep.jsonl`` (this folder's README): per shape and arch, the ``tl`` tile and the Gluon
kernel in ms, the speedup, and the Gluon kernel against the run's limits (``of bf16`` at 64 / 128 heads, ``of copy``
at 16 / 32); under sm_120 also the earlier kernel (``HEAD_KERNEL``) when the sweep timed it.

    python table.py <dir>/sweep.jsonl [arbitrary|pow2]
"""

import json
import sys


def rows(path: str) -> tuple[dict, list[dict]]:
    lines = [json.loads(x) for x in open(path) if x.strip()]
    return lines[0], [x for x in lines[1:] if "arch" in x]


def table(path: str, scales: str) -> str:
    limits, data = rows(path)
    out = [f"{limits['gpu']}: copy {limits['copy_gbps']:.0f} GB/s, bf16 {limits['bf16_tflops']:.1f} TFLOP/s; "
           f"scales {scales}", "",
           "| B | s_q | h_q | arch | `tl` ms | Gluon ms | speedup | Gluon | `tl` | earlier kernel ms | max abs diff |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in data:
        r = d[f"scales={scales}"]
        limit = "bf16" if d["h_q"] >= 64 else "copy"
        head = f"{r['head_ms']:.4f} ({r['vs_head']:.2f}x)" if "head_ms" in r else ""
        out.append(f"| {d['B']} | {d['s_q']} | {d['h_q']} | {d['arch']} | {r['tl_ms']:.4f} | {r['mma_v2_ms']:.4f} | "
                   f"{r['speedup']:.2f}x | {r[f'mma_v2_vs_{limit}']:.3f} of {limit} | {r[f'tl_vs_{limit}']:.3f} | "
                   f"{head} | {r['max_abs_diff']:.2e} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "arbitrary"))
