"""The benchmark run: limits, every selected family, ratios, environment record, output files.

:func:`run_suite` measures the hardware limits, imports ``nsa_backend.bench.<family>`` for each
selected family and calls its ``run(quick, limits)``, adds the standard ratios to the rows
(:func:`compute_ratios`), records the environment and writes into the output directory:

- ``results.json``: everything, validated against :data:`nsa_backend.bench.schema.SCHEMA`;
- ``results.md``: the environment, the limits and one table per family;
- ``results.csv``: one line per row;
- ``<family>.png``: ratio bars per family (needs matplotlib; skipped with a warning without it).
"""

from __future__ import annotations

import csv
import datetime
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from nsa_backend.bench import FAMILIES, builtin, proxy, roofline
from nsa_backend.bench.limits import LIMIT_KEYS, limit_sizes, measure_limits
from nsa_backend.bench.schema import SCHEMA_VERSION, validate, validate_row
from nsa_backend.routing.router import OP_FAMILY as ROUTE_FAMILY

# Implementations of this package: the rows the "vs_<impl>" ratios are computed for.
OURS_IMPLS: tuple[str, ...] = ("triton", "triton-graph")
# Rows timed as CUDA-graph replays carry this suffix; they are compared only with each other.
GRAPH_SUFFIX = "-graph"
NATIVE_MODULES: tuple[str, ...] = ("deep_gemm", "flash_mla", "flashinfer")

# Benchmark family of every public op (for ``--ops <op name>``), from the op's routing family.
_BENCH_FAMILY_OF_ROUTE: dict[str | None, str] = {
    "indexer": "indexer",
    "topk": "topk",
    "prefill": "sparse_mla",
    "decode": "sparse_mla",
    "hc_prenorm": "mhc",
}
# DeepSeek-V4's MXFP4 indexer and cache write have a family of their own (the V4 decode is in "peers").
_V4_OPS: tuple[str, ...] = ("fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits", "write_fp8_ds_mla_v4_cache")
OP_FAMILY: dict[str, str] = {op: "v4" if op in _V4_OPS else _BENCH_FAMILY_OF_ROUTE[route]
                             for op, route in ROUTE_FAMILY.items()}

# The hardware limits that bound each op; a row may name its own with the key "limit".
# Ops not listed get a ratio against every limit its row has a rate for.
OP_LIMITS: dict[str, tuple[str, ...]] = {
    "fp8_mqa_logits": ("fp8_tflops",),
    "fp8_paged_mqa_logits": ("fp8_tflops", "copy_gbps"),
    "get_paged_mqa_logits_metadata": (),
    "pack_indexer_k_cache": ("copy_gbps",),
    "topk_indices": ("copy_gbps",),
    "logical_to_global_indices": ("copy_gbps",),
    "flash_mla_sparse_fwd": ("bf16_tflops",),
    "sparse_mla_decode": ("copy_gbps", "bf16_tflops"),
    "pack_fp8_ds_mla": ("copy_gbps",),
    "unpack_fp8_ds_mla": ("copy_gbps",),
    "write_fp8_ds_mla_cache": ("copy_gbps",),
    "fp8_fp4_mqa_logits": ("fp8_tflops",),
    "fp8_fp4_paged_mqa_logits": ("fp8_tflops", "copy_gbps"),
    "write_fp8_ds_mla_v4_cache": ("copy_gbps",),
    "tf32_hc_prenorm_gemm": ("copy_gbps",),
}

# Ratio name for each limit: the row's rate divided by the measured limit.
LIMIT_RATIO: dict[str, str] = {"copy_gbps": "of_copy", "bf16_tflops": "of_bf16_mm", "fp8_tflops": "of_fp8_mm"}
_RATE_OF_LIMIT: dict[str, str] = {"copy_gbps": "gbps", "bf16_tflops": "tflops", "fp8_tflops": "tflops"}


# ----------------------------------------------------------------------------------------------
# Rows and ratios
# ----------------------------------------------------------------------------------------------

def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number or None, got {type(value).__name__} {value!r:.60}")
    value = float(value)
    return value if math.isfinite(value) else None


def normalize_row(row: dict[str, Any], family: str) -> dict[str, Any]:
    """A family row in the result's form: numbers as floats, defaults for the optional keys.

    Required keys: ``op``, ``impl``, ``ms``; ``family`` is set to the family run, ``shape`` defaults to
    ``""``, ``tflops``/``gbps`` to ``None``, ``ratios`` to ``{}``; ``limit`` may be one limit
    name or a list of them. Non-finite numbers become ``None``. Raises ``ValueError``.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{family}: expected each row to be a dict, got {type(row).__name__}")
    for key in ("op", "impl", "ms"):
        if key not in row:
            raise ValueError(f"{family}: row is missing {key!r}: {row!r:.200}")
    out = dict(row)
    out["family"] = family
    out["op"] = str(row["op"])
    out["impl"] = str(row["impl"])
    shape = row.get("shape", "")
    out["shape"] = {str(k): (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                    for k, v in shape.items()} if isinstance(shape, dict) else str(shape)
    for key in ("ms", "tflops", "gbps"):
        out[key] = _number(row.get(key), f"{family}.{out['op']}.{key}")
    if out["ms"] is not None and out["ms"] <= 0:
        out["ms"] = None
    ratios = row.get("ratios") or {}
    if not isinstance(ratios, dict):
        raise ValueError(f"{family}: expected 'ratios' to be a dict, got {type(ratios).__name__}")
    out["ratios"] = {str(k): _number(v, f"{family}.{out['op']}.ratios.{k}") for k, v in ratios.items()}
    limit = row.get("limit")
    if limit is not None:
        limit = [limit] if isinstance(limit, str) else list(limit)
        unknown = [name for name in limit if name not in LIMIT_KEYS]
        if unknown:
            raise ValueError(f"{family}: unknown limit names {unknown}; expected some of {list(LIMIT_KEYS)}")
        out["limit"] = limit
    validate_row(out)
    return out


def shape_label(shape: str | dict[str, Any]) -> str:
    """``{"S": 4096, "N": 8192}`` -> ``"S=4096 N=8192"``; strings unchanged."""
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    return shape


def _group_key(row: dict[str, Any]) -> tuple[str, str, str]:
    shape = row["shape"]
    key = json.dumps(shape, sort_keys=True) if isinstance(shape, dict) else shape
    return row["family"], row["op"], key


def compute_ratios(rows: Sequence[dict[str, Any]], limits: dict[str, float | None],
                   ours: Iterable[str] = OURS_IMPLS) -> list[dict[str, Any]]:
    """Rows with the standard ratios added (a ratio a family module set itself wins unless it is None).

    - ``of_copy`` / ``of_bf16_mm`` / ``of_fp8_mm``: the row's GB/s or TFLOP/s divided by the
      measured copy bandwidth / bf16 / fp8 matmul rate, for the limits that bound the op
      (``OP_LIMITS`` or the row's ``limit``); every row gets them.
    - ``vs_<impl>``: for rows of our implementations, ``ms of <impl> / ms of this row`` on the same
      family, op and shape: how many times faster than ``<impl>`` (``> 1`` is faster). Eager rows are
      compared with eager rows, CUDA-graph rows (``*-graph``) with CUDA-graph rows.
    - ``of_roofline``: for rows that got both a memory (``of_copy``) and one compute (``of_bf16_mm`` or
      ``of_fp8_mm``) ratio, the larger of the two (:func:`nsa_backend.bench.roofline.of_roofline`):
      the row's time as a share of the time a kernel at the measured limits would need.
    """
    ours = set(ours)
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_group_key(row), {}).setdefault(row["impl"], row)
    out = []
    for row in rows:
        ratios: dict[str, float | None] = {}
        names = row.get("limit")
        if names is None:
            names = OP_LIMITS.get(row["op"], LIMIT_KEYS)
        for name in names:
            rate, limit = row.get(_RATE_OF_LIMIT[name]), limits.get(name)
            if rate is not None and limit:
                ratios[LIMIT_RATIO[name]] = rate / limit
        ms = row.get("ms")
        if row["impl"] in ours and ms:
            graphed = row["impl"].endswith(GRAPH_SUFFIX)
            for impl, other in groups[_group_key(row)].items():
                if impl != row["impl"] and other.get("ms") and impl.endswith(GRAPH_SUFFIX) == graphed:
                    ratios[f"vs_{impl}"] = other["ms"] / ms
        for name, value in (row.get("ratios") or {}).items():
            if value is not None or name not in ratios:
                ratios[name] = value
        share = roofline.of_roofline(ratios)
        if share is not None and ratios.get("of_roofline") is None:
            ratios["of_roofline"] = share
        out.append({**row, "ratios": ratios})
    return out


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------

@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _dist_version(module: str) -> str | None:
    """Installed version of the distribution providing top-level ``module``; None if absent."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in _module_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _run(cmd: Sequence[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _git(args: Sequence[str]) -> str | None:
    if shutil.which("git") is None:
        return None
    return _run(["git", *args], cwd=Path(__file__).resolve().parents[2])


def environment(git_commit: str | None = None) -> dict[str, Any]:
    """GPU, driver and package versions, and the git commit of the package source tree."""
    import nsa_backend

    env: dict[str, Any] = {"gpu_name": None, "capability": None, "driver": None, "cuda": torch.version.cuda,
                           "sm_count": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu_name=props.name, capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count)
        if shutil.which("nvidia-smi"):
            out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
            env["driver"] = out.splitlines()[0].strip() if out else None
    env.update(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        triton=_dist_version("triton"),
        nsa_backend=nsa_backend.__version__,
        native={name: _dist_version(name) for name in NATIVE_MODULES},
    )
    if git_commit:
        env.update(git_commit=git_commit, git_dirty=None)
    else:
        commit = _git(["rev-parse", "HEAD"])
        status = _git(["status", "--porcelain", "--untracked-files=no"]) if commit else None
        env.update(git_commit=commit, git_dirty=None if status is None else bool(status))
    return env


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this run, as a user would type it."""
    argv = list(sys.argv if argv is None else argv)
    prog = os.path.basename(argv[0]) if argv else "nsa-backend"
    if prog == "__main__.py":
        head = ["python", "-m", "nsa_backend.bench"]
    elif prog == "cli.py":
        head = ["python", "-m", "nsa_backend.cli"]
    elif prog.startswith("nsa-backend"):
        head = ["nsa-backend"]
    else:
        head = [prog]
    return shlex.join(head + argv[1:])


def device_slug(gpu_name: str | None) -> str:
    """Results folder name of a device: ``"NVIDIA H200"`` -> ``"h200"``, no GPU -> ``"cpu"``."""
    if not gpu_name:
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", gpu_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------

def select(ops: Sequence[str] | None) -> tuple[list[str], dict[str, set[str]]]:
    """Families to run and, per family, the op names to keep (empty set: all).

    ``ops`` holds family names and/or public op names; ``None`` or empty selects everything.
    """
    if not ops:
        return list(FAMILIES), {}
    families: list[str] = []
    only: dict[str, set[str]] = {}
    whole: set[str] = set()
    for name in ops:
        if name in FAMILIES:
            family = name
            whole.add(family)
        elif name in OP_FAMILY:
            family = OP_FAMILY[name]
            only.setdefault(family, set()).add(name)
        else:
            raise ValueError(f"--ops: unknown family or op {name!r}; families: {list(FAMILIES)}, "
                             f"ops: {sorted(OP_FAMILY)}")
        if family not in families:
            families.append(family)
    for family in whole:
        only.pop(family, None)
    return [f for f in FAMILIES if f in families], only


def _load_family(module_name: str) -> Any | None:
    """The family module, or None when it does not exist (import errors inside it propagate)."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(module_name)


def _run_family(family: str, module_name: str, quick: bool, limits: dict[str, float | None],
                keep_ops: set[str] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    t0 = time.perf_counter()
    info: dict[str, Any] = {"status": "ok", "source": "module", "rows": 0, "seconds": 0.0, "note": None}
    rows: list[dict[str, Any]] = []
    try:
        module = _load_family(module_name)
        if module is None:
            if quick and family in builtin.CASES:
                info.update(source="builtin", note=f"no module {module_name}: built-in tiny case")
                raw = builtin.run(family, quick, limits)
            else:
                info.update(status="skipped", source="none", note=f"no module {module_name}")
                raw = []
        else:
            raw = module.run(quick, limits)
        rows = [normalize_row(r, family) for r in raw]
        if keep_ops:
            rows = [r for r in rows if r["op"] in keep_ops]
    except Exception as exc:  # one failing family must not lose the others' results
        traceback.print_exc(file=sys.stderr)
        info.update(status="error", note=f"{type(exc).__name__}: {exc}"[:2000])
        rows = []
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError as exc:  # e.g. an illegal memory access surfacing late
            traceback.print_exc(file=sys.stderr)
            info.update(status="error", note=f"after the run: {type(exc).__name__}: {exc}"[:2000])
            rows = []
    info.update(rows=len(rows), seconds=round(time.perf_counter() - t0, 3))
    return rows, info


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True, soft_wrap=True), disable=not enabled)


def run_suite(
    ops: Sequence[str] | None = None,
    *,
    quick: bool = False,
    out: str | os.PathLike[str] | None = None,
    plots: bool = True,
    progress: bool = True,
    git_commit: str | None = None,
    argv: Sequence[str] | None = None,
    modules: dict[str, str] | None = None,
    proxy_arch: str | None = None,
) -> tuple[dict[str, Any], Path]:
    """Run the benchmark suite and write its files; returns ``(result, output directory)``.

    Parameters
    ----------
    ops : sequence of str, optional
        Family names (``indexer``, ``topk``, ``sparse_mla``, ``mhc``) and/or public op names.
    quick : bool
        Small shape sets and short limit measurements; always on without a GPU, where families
        run their tiny reference-path cases (or the built-in case of a family without a module).
    out : path, optional
        Output directory; default ``bench/results/<device>`` (e.g. ``bench/results/h200``).
    plots, progress : bool
        Write the PNG plots / show a progress bar.
    git_commit : str, optional
        Commit to record instead of asking git (for copies of the tree without ``.git``).
    argv : sequence of str, optional
        Command line to record (default ``sys.argv``).
    modules : dict, optional
        Family -> module name overrides (default ``nsa_backend.bench.<family>``).
    proxy_arch : str, optional
        Time the route of this mma.sync arch (``sm120``, ``sm89``, ...) on a Hopper GPU
        (:mod:`nsa_backend.bench.proxy`); results go to ``bench/results/<gpu>-proxy-<arch>`` by default,
        with ``sass.md``. Raises ``ValueError`` before anything runs when the GPU cannot serve as the proxy.
    """
    families, only = select(ops)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    settings = None
    if proxy_arch is not None:
        settings = proxy.enable(proxy_arch, torch.cuda.get_device_capability() if on_gpu else None)
    if not on_gpu and not quick:
        warnings.warn("bench: no CUDA GPU, running the quick reference-path cases", RuntimeWarning, stacklevel=2)
        quick = True
    env = environment(git_commit)
    slug = device_slug(env["gpu_name"]) + (f"-proxy-{settings.arch}" if settings is not None else "")
    out_dir = Path(out) if out is not None else Path("bench", "results", slug)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "argv": list(sys.argv if argv is None else argv),
        "device": device,
        "quick": quick,
        "environment": env,
        "limits": dict.fromkeys(LIMIT_KEYS),
        "limit_sizes": limit_sizes(device, quick),
        "families": {},
        "rows": [],
    }
    if settings is not None:
        result["proxy"] = {**settings.record(), "sass": None}
    with _progress(progress) as bar:
        task = bar.add_task("limits", total=len(families) + 1)
        limits = result["limits"] = measure_limits(
            device, quick, mma_sync_smem=settings.shared_memory_limit if settings is not None else None)
        bar.advance(task)
        for family in families:
            bar.update(task, description=family)
            module_name = (modules or {}).get(family, f"nsa_backend.bench.{family}")
            family_rows, info = _run_family(family, module_name, quick, limits, only.get(family))
            rows.extend(family_rows)
            result["families"][family] = info
            result["rows"] = compute_ratios(rows, limits)
            # Results so far are on disk after every family, so a run cut short keeps them.
            write_results(result, out_dir, plots=False)
            if progress:
                bar.console.print(f"{family}: {info['status']} ({info['source']}), {info['rows']} rows, "
                                  f"{info['seconds']:.1f} s" + (f": {info['note']}" if info["note"] else ""))
            bar.advance(task)
        bar.update(task, description="done")
    if settings is not None:
        sass = proxy.scan_sass(settings.triton_cache_dir, settings.shared_memory_limit)
        result["proxy"]["sass"] = {key: sass[key] for key in ("ok", "problem", "totals")}
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sass.md").write_text(proxy.sass_markdown(result["proxy"], sass))
    write_results(result, out_dir, plots=plots)
    return result, out_dir


# ----------------------------------------------------------------------------------------------
# Output files
# ----------------------------------------------------------------------------------------------

def write_results(result: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Validate ``result`` and write results.json, results.md, results.csv and the plots."""
    validate(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "results.csv"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    write_csv(result, paths[2])
    if plots:
        paths += write_plots(result, out_dir)
    return paths


def replot(src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
           plots: bool = True) -> tuple[dict[str, Any], Path]:
    """Rewrite results.md, results.csv and the plots from an existing results.json (no measuring).

    ``src`` is the results.json file or its directory; the files go next to it unless ``out`` is
    given. For runs on machines without matplotlib.
    """
    path = Path(src)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ValueError(f"--replot: expected a results.json file or a directory holding one, got {str(src)!r}")
    result = json.loads(path.read_text())
    validate(result)
    out_dir = Path(out) if out is not None else path.parent
    write_results(result, out_dir, plots=plots)
    return result, out_dir


def _fmt(value: float | None, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def _rate(value: float | None, unit: str) -> str:
    return "not measured" if value is None else f"{value:.4g} {unit}"


def fmt_ratio(name: str, value: float | None) -> str:
    """``vs_*`` as a speed-up (``2.31x``), ``of_*`` as a percentage, anything else plainly."""
    if value is None:
        return ""
    if name.startswith("vs_"):
        return f"{value:.3g}x"
    if name.startswith("of_"):
        return f"{100 * value:.1f}%"
    return f"{value:.3g}"


def _ratio_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    names = {name for row in rows for name in row["ratios"]}
    order = {"vs": 0, "of": 1}
    return sorted(names, key=lambda n: (order.get(n.split("_")[0], 2), n))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown document: environment, limits, one table per family."""
    env, limits, sizes = result["environment"], result["limits"], result["limit_sizes"]
    gpu = env["gpu_name"] or "no GPU (CPU)"
    if env["capability"]:
        gpu += f", compute capability {env['capability']}"
    native = ", ".join(f"{k} {v}" for k, v in env["native"].items() if v) or "none"
    commit = env["git_commit"] or "unknown"
    if env["git_dirty"]:
        commit += " (with uncommitted changes)"
    prx = result.get("proxy")
    mm_label = " (Triton, mma.sync)" if prx else ""
    fp8_label = " (Triton, mma.sync)" if prx else " (torch._scaled_mm)"
    lines = [
        "# nsa-backend benchmark results",
        "",
        f"Command: `{result['command']}`",
        "",
        "| | |",
        "|---|---|",
        f"| GPU | {gpu} |",
        f"| driver / CUDA | {env['driver'] or '-'} / {env['cuda'] or '-'} |",
        f"| torch / triton | {env['torch']} / {env['triton'] or 'not installed'} |",
        f"| native kernels | {native} |",
        f"| nsa-backend | {env['nsa_backend']}, commit {commit} |",
        f"| created | {result['created']}{' (quick mode)' if result['quick'] else ''} |",
        *_proxy_lines(prx),
        "",
        "## Hardware limits measured in this run",
        "",
        "| limit | value | size |",
        "|---|---|---|",
        f"| device-to-device copy (bytes read + written) | {_rate(limits['copy_gbps'], 'GB/s')} "
        f"| {_size(sizes['copy_bytes'])} |",
        f"| bf16 matmul{mm_label} | {_rate(limits['bf16_tflops'], 'TFLOP/s')} | {sizes['matmul_n']}^3 |",
        f"| fp8 matmul{fp8_label} | {_rate(limits['fp8_tflops'], 'TFLOP/s')} | {sizes['matmul_n']}^3 |",
        "",
        "Ratios: `vs_<impl>` = ms of `<impl>` / ms of this row (how many times faster, > 1 is faster); "
        "`of_copy`, `of_bf16_mm`, `of_fp8_mm` = this row's GB/s or TFLOP/s as a fraction of the limit above. "
        "TFLOP/s counts useful FLOPs only.",
    ]
    for family, info in result["families"].items():
        lines += ["", f"## {family}", ""]
        if info["note"]:
            lines += [f"{info['status']} ({info['source']}): {info['note']}", ""]
        rows = [r for r in result["rows"] if r["family"] == family]
        if not rows:
            continue
        cols = _ratio_columns(rows)
        lines.append("| " + " | ".join(["op", "shape", "impl", "ms", "TFLOP/s", "GB/s", *cols]) + " |")
        lines.append("|" + "---|" * (6 + len(cols)))
        for r in rows:
            cells = [r["op"], shape_label(r["shape"]), r["impl"], _fmt(r["ms"]) or (r.get("note") or "failed"),
                     _fmt(r["tflops"]), _fmt(r["gbps"]), *(fmt_ratio(c, r["ratios"].get(c)) for c in cols)]
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _proxy_lines(prx: dict[str, Any] | None) -> list[str]:
    if not prx:
        return []
    sass = prx.get("sass") or {}
    verdict = "not checked" if not sass else ("held" if sass["ok"] else f"broken: {sass['problem']}")
    totals = sass.get("totals") or {}
    return [f"| proxy | {prx['arch']} on this GPU: `DISABLE_MMA_V3=1` (tl.dot as mma.sync), routing and launch "
            f"configurations of {prx['arch']}, {prx['shared_memory_limit']} B shared memory per block"
            f"{proxy.per_sm_text(prx)}, {proxy.gluon_text(prx)}, native packages off |",
            f"| SASS check | {verdict}; {totals.get('kernels', 0)} kernels, {totals.get('warp_mma', 0)} mma.sync and "
            f"{totals.get('warpgroup_mma', 0)} warpgroup MMA instructions (sass.md) |"]


def write_csv(result: dict[str, Any], path: Path) -> None:
    """One line per row: family, op, shape, impl, ms, tflops, gbps and every ratio column."""
    rows = result["rows"]
    cols = _ratio_columns(rows)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["family", "op", "shape", "impl", "ms", "tflops", "gbps", *cols])
        for r in rows:
            w.writerow([r["family"], r["op"], shape_label(r["shape"]), r["impl"], r["ms"], r["tflops"], r["gbps"],
                        *(r["ratios"].get(c) for c in cols)])


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per family with ratio bars (log scale, 1.0 marked); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("bench: matplotlib is not installed, no plots written (pip install 'nsa-backend[bench]')",
                      RuntimeWarning, stacklevel=2)
        return []
    gpu = result["environment"]["gpu_name"] or "CPU"
    paths = []
    for family in result["families"]:
        rows = [r for r in result["rows"] if r["family"] == family]
        ours = [r for r in rows if r["impl"] in OURS_IMPLS and r["ratios"]]
        shown = ours or [r for r in rows if r["ratios"]]
        cols = _ratio_columns(shown)
        fig, ax = plt.subplots(figsize=(min(24.0, max(6.0, 1.5 + 0.35 * len(shown) * max(1, len(cols)))), 5.0))
        if not shown or not cols:
            ax.text(0.5, 0.5, "no ratios measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        else:
            width = 0.8 / len(cols)
            for j, col in enumerate(cols):
                xs = [i + (j - (len(cols) - 1) / 2) * width for i in range(len(shown))]
                ys = [r["ratios"].get(col) or float("nan") for r in shown]
                ax.bar(xs, ys, width=width, label=col)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_xticks(range(len(shown)))
            ax.set_xticklabels([f"{r['op']}\n{shape_label(r['shape'])}\n[{r['impl']}]" for r in shown],
                               fontsize=7, rotation=0 if len(shown) <= 4 else 30,
                               ha="center" if len(shown) <= 4 else "right")
            ax.set_ylabel("ratio (vs_*: speed-up, of_*: fraction of limit)")
            ax.legend(fontsize=8)
            ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_title(f"{family} on {gpu}{' (quick)' if result['quick'] else ''}")
        fig.tight_layout()
        path = out_dir / f"{family}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
