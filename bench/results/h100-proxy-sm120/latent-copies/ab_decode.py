"""The fp8 mma.sync decode of each candidate (``CANDS``: space-separated ``name:path`` pairs, each path a candidate's
``sparse_mla_decode/sm89_gluon.py``) against the tree's, same process, under the proxy with
sm_120's shared memory per SM (CUDA graphs, L2 evicted before each call): B 128, s_q 1, top-k 2048, routed for sm_120
and for sm_86, both scale formats, at the head counts ``H_DECODE`` (default 16,32,64,128). Each pair is timed twice,
alternating. The tree's decode is also timed with every key from one page (``hot_key_inputs``: the tile without
the gather), and so is each candidate's.

    DISABLE_MMA_V3=1 PYTHONPATH=. OUT=<dir> CANDS="name:path ..." python ab_decode.py   # <OUT>/ab.jsonl
"""

import importlib.util
import json
import os

import torch

from nsa_backend.bench import proxy
from nsa_backend.bench.limits import copy_gbps
from nsa_backend.bench.sparse_mla import decode_inputs, hot_key_inputs
from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as fp8_decode

TOPK = 2048


def _score_exchange_ab():
    """The score-exchange folder's ``ab.py``, whose ``load`` (a module from a path) and ``forced`` (a call routed as
    an arch) this script shares."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "score-exchange", "ab.py")
    spec = importlib.util.spec_from_file_location("score_exchange_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_SHARED = _score_exchange_ab()
load, forced = _SHARED.load, _SHARED.forced


def main() -> None:
    proxy.limit_shared_memory_per_sm("sm120")
    dev = torch.device("cuda")
    specs = [c.split(":", 1) for c in os.environ["CANDS"].split()]
    cands = {name: load(f"cand_{name}", path) for name, path in specs}
    log_path = os.path.join(os.environ.get("OUT", "."), "ab.jsonl")

    def emit(row: dict) -> None:  # each row lands on disk at once: a run cut short keeps what it measured
        line = json.dumps(row)
        print(line, flush=True)
        with open(log_path, "a") as log:
            log.write(line + "\n")

    copy = copy_gbps(dev, 2 * 2**30)
    emit({"cands": list(cands), "copy_gbps": copy, "gpu": torch.cuda.get_device_name()})

    def decode(mod, args: tuple, fmt: str | None):
        return lambda: mod.sparse_mla_decode_mma_v2(*args, kv_scale_format=fmt)

    def pairs(row: dict, fmt: str | None, args: tuple, hot_args: tuple, nbytes: int) -> None:
        tree = decode(fp8_decode, args, fmt)
        want = tree()[0].float()
        for rnd in range(2):
            ms_t = bench_ms(tree, graph=True)
            r = {**row, "round": rnd, "tree_ms": round(ms_t, 4), "tree_vs_copy": round(nbytes / ms_t / 1e6 / copy, 3)}
            for name, mod in cands.items():
                ms_c = bench_ms(decode(mod, args, fmt), graph=True)
                r[f"{name}_ms"] = round(ms_c, 4)
                r[f"{name}_speedup"] = round(ms_t / ms_c, 3)
                if rnd == 0:
                    r[f"{name}_max_abs_diff"] = (decode(mod, args, fmt)()[0].float() - want).abs().max().item()
                    r[f"{name}_hot_ms"] = round(bench_ms(decode(mod, hot_args, fmt), graph=True), 4)
            if rnd == 0:
                r["tree_hot_ms"] = round(bench_ms(decode(fp8_decode, hot_args, fmt), graph=True), 4)
            emit(r)

    for h_q in [int(h) for h in os.environ.get("H_DECODE", "16,32,64,128").split(",")]:
        a = decode_inputs(128, 1, h_q, TOPK, dev)
        hot = hot_key_inputs(a, "fp8_ds_mla")
        args = (a["q"], a["kv_cache"], a["indices"], a["sm_scale"])
        hot_args = (hot["q"], hot["kv_cache"], hot["indices"], hot["sm_scale"])
        for arch in ("sm120", "sm86"):
            for fmt in ("pow2", None):
                row = {"arch": arch, "scales": fmt or "any", "h_q": h_q}
                forced(arch, lambda row=row, fmt=fmt, args=args, hot_args=hot_args: pairs(
                    row, fmt, args, hot_args, 128 * TOPK * 656))
        del a, hot
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
