"""Settings of the vLLM integration: the ``[vllm]`` table of the nsa-backend config file.

::

    # $NSA_BACKEND_CONFIG
    [vllm]
    takeover = "off"      # "off" | "auto" | "on" | ["FLASHINFER_MLA_SPARSE_SM120", "FLASHMLA_SPARSE"]
    indexer = "auto"      # "auto" | "on" | "off"
    hc_prenorm = "auto"   # "auto" | "on" | "off"

- ``takeover`` (``off``, ``auto``, ``on`` or a list of backend names; default ``off``): serve vLLM's
  sparse-MLA backend names with nsa-backend. ``auto``: ``FLASHINFER_MLA_SPARSE_SM120`` on SM12x and
  ``FLASHMLA_SPARSE`` on SM8x (GPUs without a native sparse-MLA kernel); ``on``: both names on every GPU.
- ``indexer`` (``auto``, ``on``, ``off``; default ``auto``): replace vLLM's ``SparseAttnIndexer``.
  ``auto``: vLLM's op stays wherever the DeepGEMM vLLM uses runs the indexer for the layer's shape
  (:func:`deep_gemm_serves_indexer`: SM90, SM100 and, with a build that has the ``sm120_*`` kernels
  such as the DeepGEMM 2.8.1 bundled with vLLM 0.33 / 0.34, SM120 / SM121 at 32 or 64 indexer heads);
  nsa-backend runs it elsewhere (SM8x, other head counts, page sizes the build refuses).
- ``hc_prenorm`` (``auto``, ``on``, ``off``; default ``auto``): route DeepGEMM's ``tf32_hc_prenorm_gemm``
  to nsa-backend. ``auto``: per call, where vLLM's DeepGEMM has no kernel for the arch and shape
  (:func:`deep_gemm_serves_hc_prenorm`).

Each key can be overridden by an environment variable (``NSA_BACKEND_VLLM_TAKEOVER``,
``NSA_BACKEND_VLLM_INDEXER``, ``NSA_BACKEND_VLLM_HC_PRENORM``); a takeover list is written
comma-separated there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any

from nsa_backend.routing import capabilities as caps
from nsa_backend.routing.config import load_config

logger = logging.getLogger("nsa_backend.vllm")

TAKEOVER_ENV = "NSA_BACKEND_VLLM_TAKEOVER"
INDEXER_ENV = "NSA_BACKEND_VLLM_INDEXER"
HC_PRENORM_ENV = "NSA_BACKEND_VLLM_HC_PRENORM"

# vLLM sparse-MLA backend names that nsa-backend can serve.
TAKEOVER_NAMES: tuple[str, ...] = ("FLASHINFER_MLA_SPARSE_SM120", "FLASHMLA_SPARSE")
MODES: tuple[str, ...] = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """Resolved ``[vllm]`` settings.

    ``takeover`` is ``"auto"`` or the explicit tuple of vLLM backend names to serve (empty: none).
    """

    takeover: str | tuple[str, ...] = ()
    indexer: str = "auto"
    hc_prenorm: str = "auto"


def _parse_takeover(value: Any, source: str) -> str | tuple[str, ...]:
    if isinstance(value, str):
        word = value.strip()
        if word.lower() in ("off", "false", "0", "no", "none", ""):
            return ()
        if word.lower() in ("on", "true", "1", "yes", "all"):
            return TAKEOVER_NAMES
        if word.lower() == "auto":
            return "auto"
        names: list[Any] = [w.strip() for w in word.split(",") if w.strip()]
    elif isinstance(value, bool):
        return TAKEOVER_NAMES if value else ()
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise ValueError(
            f"{source}: expected 'off', 'auto', 'on' or a list of {list(TAKEOVER_NAMES)}, got {value!r}"
        )
    bad = [n for n in names if n not in TAKEOVER_NAMES]
    if bad:
        raise ValueError(f"{source}: expected backend names from {list(TAKEOVER_NAMES)}, got {bad}")
    return tuple(dict.fromkeys(names))


def _parse_mode(value: Any, source: str) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or value.strip().lower() not in MODES:
        raise ValueError(f"{source}: expected one of {list(MODES)}, got {value!r}")
    return value.strip().lower()


def _config_table(path: str | os.PathLike[str] | None) -> Mapping[str, Any]:
    """The ``[vllm]`` table of the config file at ``path`` (``None``: the file named by
    ``$NSA_BACKEND_CONFIG``); empty when there is no file or no table."""
    return load_config(path).integrations.get("vllm", {})


def load_settings(path: str | os.PathLike[str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> VllmSettings:
    """Read the settings: config file, then environment variables, then ``overrides``.

    Parameters
    ----------
    path : str or os.PathLike, optional
        Config file whose ``[vllm]`` table is read (default: ``$NSA_BACKEND_CONFIG``, else none).
    overrides : Mapping, optional
        Values that win over the file and the environment, by key (``takeover``, ``indexer``,
        ``hc_prenorm``).

    Raises
    ------
    ValueError
        An unknown key or value (a :class:`~nsa_backend.routing.config.ConfigError` when the file
        itself cannot be read or parsed).
    """
    raw: dict[str, Any] = dict(_config_table(path))
    unknown = sorted(set(raw) - {"takeover", "indexer", "hc_prenorm"})
    if unknown:
        raise ValueError(f"[vllm] config: unknown keys {unknown}; expected takeover, indexer, hc_prenorm")
    for key, var in (("takeover", TAKEOVER_ENV), ("indexer", INDEXER_ENV), ("hc_prenorm", HC_PRENORM_ENV)):
        value = os.environ.get(var)
        if value:
            raw[key] = value
    raw.update(overrides or {})
    return VllmSettings(
        takeover=_parse_takeover(raw.get("takeover", "off"), "vllm.takeover"),
        indexer=_parse_mode(raw.get("indexer", "auto"), "vllm.indexer"),
        hc_prenorm=_parse_mode(raw.get("hc_prenorm", "auto"), "vllm.hc_prenorm"),
    )


def auto_takeover_names(arch: str | None) -> tuple[str, ...]:
    """Backend names that nsa-backend serves under ``takeover = "auto"`` on arch family ``arch``.

    sm120 / sm121: ``FLASHINFER_MLA_SPARSE_SM120`` (FlashInfer covers only fixed decode buckets there).
    sm80 / sm86 / sm89: ``FLASHMLA_SPARSE`` (vLLM has no sparse-MLA kernel below SM90). Elsewhere: none.
    """
    if arch in ("sm120", "sm121"):
        return ("FLASHINFER_MLA_SPARSE_SM120",)
    if arch in ("sm80", "sm86", "sm89"):
        return ("FLASHMLA_SPARSE",)
    return ()


# Where vLLM finds DeepGEMM: an installed ``deep_gemm`` first, then the copy in its wheel
# (``vllm.utils.deep_gemm._import_deep_gemm``).
_VLLM_DEEP_GEMM_PACKAGES: tuple[str, ...] = ("deep_gemm", "vllm.third_party.deep_gemm")


def _package_dir(name: str) -> str | None:
    """Directory of package ``name`` without importing it (parents of a dotted name are located the
    same way, so ``vllm`` itself is not imported either)."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    path = os.path.join(root, *rest.split(".")) if rest else root
    return path if os.path.isfile(os.path.join(path, "__init__.py")) else None


@functools.cache
def vllm_deep_gemm_status() -> caps.NativeStatus:
    """The DeepGEMM vLLM would load: an installed ``deep_gemm`` as nsa-backend's probe sees it (its API
    level read from the module), else vLLM's bundled copy read from its files (no import, no GPU)."""
    for name in _VLLM_DEEP_GEMM_PACKAGES:
        path = _package_dir(name)
        if path is None:
            continue
        if name == "deep_gemm":
            return caps.probe_natives()["deep_gemm"]
        library = caps.read_deep_gemm_library(path)
        if library is None:
            return caps.NativeStatus("deep_gemm", False, caps.package_version_in(path),
                                     f"{name} at {path} has no compiled library (_C*.so)")
        return caps.NativeStatus("deep_gemm", True, caps.package_version_in(path), library=library)
    return caps.NativeStatus("deep_gemm", False, None,
                             f"neither {' nor '.join(_VLLM_DEEP_GEMM_PACKAGES)} is installed")


def _vllm_deep_gemm_disabled() -> str | None:
    """Why vLLM itself would not run DeepGEMM kernels on any GPU (``VLLM_USE_DEEP_GEMM=0``; from
    vLLM 0.34 a missing or older-than-12.9 nvcc for DeepGEMM's JIT), or ``None``."""
    if os.environ.get("VLLM_USE_DEEP_GEMM", "1").strip().lower() in ("0", "false", "no", "off"):
        return "VLLM_USE_DEEP_GEMM=0 turns vLLM's DeepGEMM off"
    try:
        from vllm.utils import deep_gemm as vllm_dg
    except ImportError:
        return None
    find_nvcc = getattr(vllm_dg, "_deep_gemm_nvcc_path", None)
    nvcc_version = getattr(vllm_dg, "_nvcc_version", None)
    if find_nvcc is None or nvcc_version is None:   # vLLM 0.33 does not check the toolkit
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        return "vLLM disables DeepGEMM: no nvcc for its JIT (CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda)"
    version = nvcc_version(nvcc)
    if version is not None and tuple(version) < (12, 9):
        return f"vLLM disables DeepGEMM: its JIT needs nvcc >= 12.9, found {version[0]}.{version[1]} at {nvcc}"
    return None


def _serves(checks: Mapping[str, Mapping[str, Any]], arch: str) -> tuple[bool, str]:
    """Whether the DeepGEMM vLLM loads runs every op of ``checks`` (op -> shape features) on ``arch``
    as called, i.e. without the head padding vLLM does not do."""
    status = vllm_deep_gemm_status()
    if not status.available:
        return False, f"vLLM has no usable DeepGEMM ({status.error})"
    disabled = _vllm_deep_gemm_disabled()
    if disabled is not None:
        return False, disabled
    natives = {"deep_gemm": status}
    notes = []
    for op, features in checks.items():
        verdict = caps.evaluate(op, "deep_gemm", arch, features, natives)
        if not verdict.ok:
            return False, f"vLLM's DeepGEMM {status.version or ''}: {verdict.reason}"
        padded = {k: v for k, v in verdict.padded.items() if v != features.get(k)}
        if padded:
            need = ", ".join(f"{k} {features.get(k)} -> {v}" for k, v in padded.items())
            return False, (f"vLLM's DeepGEMM {status.version or ''} {op} on {arch} needs zero-padding ({need}), "
                           "which vLLM does not do")
        if verdict.reason and verdict.reason not in notes:
            notes.append(verdict.reason)
    return True, f"vLLM's DeepGEMM {status.version or ''}: " + "; ".join(notes or ["native kernels"])


def deep_gemm_serves_indexer(arch: str, num_heads: int, head_dim: int, page_size: int) -> tuple[bool, str]:
    """Whether vLLM's own indexer runs on DeepGEMM for this shape on arch family ``arch``, and why.

    Parameters
    ----------
    arch : str
        Arch family (``"sm90"``, ``"sm120"``, ...; see :func:`nsa_backend.routing.detect_arch`).
    num_heads : int
        Indexer heads of one layer (``index_n_heads``; vLLM replicates the indexer, so every rank holds
        all of them).
    head_dim : int
        Indexer head dimension (``index_head_dim``).
    page_size : int
        KV block size the indexer's paged kernel sees (vLLM's DeepSeek-V3.2 indexer backend: 64).

    Returns
    -------
    tuple of (bool, str)
        ``(True, note)`` when the DeepGEMM vLLM loads (an installed ``deep_gemm``, else the copy in the
        vLLM wheel) has the prefill, metadata and paged logits kernels for ``arch`` and accepts the
        shape as vLLM calls it (no head padding); else ``(False, why)``. Read from the package files
        and nsa-backend's capability table; no GPU is needed.
    """
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"deep_gemm_serves_indexer: {name} must be a positive int, got {value!r}")
    idx = {"num_heads": num_heads, "head_dim": head_dim}
    checks = {
        "fp8_mqa_logits": idx,
        "get_paged_mqa_logits_metadata": {"page_size": page_size},
        # vLLM passes 2-D context lengths; next_n is 1 here (MTP adds rows, which every release with
        # 2-D lengths schedules on SM100 / SM120; SM90's {1, 2, 4} limit vLLM flattens itself).
        "fp8_paged_mqa_logits": {**idx, "page_size": page_size, "next_n": 1, "context_lens_2d": True},
    }
    return _serves(checks, arch)


def deep_gemm_serves_hc_prenorm(arch: str, n: int, k: int) -> tuple[bool, str]:
    """Whether vLLM's DeepGEMM runs ``tf32_hc_prenorm_gemm`` for ``fn`` of shape ``[n, k]`` on ``arch``."""
    return _serves({"tf32_hc_prenorm_gemm": {"n": n, "k": k}}, arch)


def deep_gemm_has_kernels(arch: str) -> bool:
    """Whether the DeepGEMM vLLM loads has indexer kernels for arch family ``arch`` at all (the shape
    decides per layer: :func:`deep_gemm_serves_indexer`). Read from its library, not assumed."""
    status = vllm_deep_gemm_status()
    if not status.available:
        return False
    return any(caps.evaluate("fp8_mqa_logits", "deep_gemm", arch, {"num_heads": heads, "head_dim": 128},
                             {"deep_gemm": status}).ok for heads in (32, 64))


def announce_model(vllm_config: Any) -> None:
    """Tell nsa-backend's routing which HF architecture is served (``[model.<arch>]`` config sections)."""
    architectures = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    if architectures:
        from nsa_backend.routing import active_model, set_active_model

        if active_model() != architectures[0]:
            set_active_model(architectures[0])
