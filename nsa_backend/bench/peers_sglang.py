"""SGLang's own SM120 fallbacks, loaded from an installed ``sglang`` package without importing it.

The ``peers`` benchmark family times these next to our kernels. ``sglang`` itself is never imported
(its package ``__init__`` pulls in the whole server): each peer is read from one file of the package
tree, found by :func:`find_sglang_root`:

- ``NSA_BACKEND_BENCH_SGLANG_ROOT=<dir>``: the directory that holds the ``sglang/`` package (a copy
  of ``site-packages`` on a machine without sglang installed);
- otherwise the installed ``sglang``, located with ``importlib.util.find_spec`` (which finds a
  top-level package without running it).

Two ways of loading, both from the installed files (nothing of SGLang is kept in this repository):

- a whole file whose module-level imports are all in :data:`ALLOWED_MODULE_IMPORTS` (torch, triton
  and the standard library) is loaded by path (:func:`load_file_module`);
- a module-level function of a file with heavier imports (``sglang.srt.*``) is compiled from that
  file's syntax tree alone, with the few module globals it reads supplied here
  (:func:`load_functions`); every global the function reads must be supplied or defined beside
  it, else the peer is unavailable. Methods buried in classes are not loaded this way.

Peers (SGLang 0.5.23; :data:`PEERS`):

- ``sglang_sm120_triton``: ``kernels/ops/attention/flash_mla_sm120_triton.py``
  ``flash_mla_sparse_decode_triton``, the Triton sparse MLA decode that ``flash_mla_sm120.py``
  dispatches to with ``SGLANG_SM120_FLASHMLA_BACKEND=triton`` (the default there is FlashInfer's
  CUTLASS kernel, which is not part of the sglang package). It reads only DeepSeek-V4's 584-byte
  block-split pages (448 e4m3 + 64 bf16 rope, 7 UE8M0 scales per token), ``s_q = 1``, and takes the
  SWA cache and the compressed (``extra``) cache as two lists merged by their LSE.
- ``sglang_sm120_torch``: ``_sm120_sparse_decode_fwd`` (+ ``_gather_and_dequant``) of
  ``flash_mla_sm120.py``, the same module's plain-PyTorch route (``SGLANG_SM120_FLASHMLA_BACKEND=torch``);
  that file imports ``sglang.srt.environ`` / ``sglang.srt.utils``, so the two functions are compiled
  from its syntax tree.
- ``sglang_torch_sm120`` / ``sglang_torch``: ``fp8_paged_mqa_logits_torch_sm120`` /
  ``fp8_paged_mqa_logits_torch`` of ``srt/layers/attention/dsv4/indexer.py``, SGLang's torch paged
  indexer logits without DeepGEMM (``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``; the first is the DSV4
  indexer's SM120 route, the second the one DSA's ``_fp8_paged_mqa_logits_torch`` calls per row chunk;
  that wrapper reads SGLang's memory-budget helpers and is not loadable). Both take ``next_n = 1`` only.
- ``sglang_torch`` for ``fp8_mqa_logits``: ``_fp8_mqa_logits_torch`` of
  ``srt/layers/attention/dsa/utils.py``, DSA's torch prefill indexer (a loop over heads).

The 656-byte DeepSeek-V3.2 cache has no peer: on SM120 SGLang decodes it with FlashInfer's
``flashinfer_sparse_mla`` (CUTLASS), and its Triton ``triton_sparse_mla`` serves prefill over a
dequantised bf16 cache only.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import hashlib
import importlib.util
import os
import re
import symtable
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SGLANG_ROOT_ENV = "NSA_BACKEND_BENCH_SGLANG_ROOT"
# Module-level imports a file may have to be loaded whole by path.
ALLOWED_MODULE_IMPORTS = frozenset({"__future__", "functools", "logging", "math", "typing", "torch", "triton"})
# Module globals supplied to functions compiled from a file's syntax tree: what those names are bound to
# in SGLang on an NVIDIA GPU (``FP8_DTYPE`` is e4m3fnuz only on ROCm).
FUNCTION_GLOBALS: dict[str, Any] = {
    "torch": torch,
    "F": torch.nn.functional,
    "FP8_DTYPE": torch.float8_e4m3fn,
    **{name: getattr(typing, name) for name in ("Any", "Optional", "Tuple", "List", "Dict")},
}


class PeerUnavailable(Exception):
    """A peer that cannot be loaded from this sglang tree; the message says why."""


@dataclasses.dataclass(frozen=True)
class SglangTree:
    """Where the ``sglang/`` package was found: ``root`` holds it, ``origin`` says how it was chosen."""

    root: Path
    origin: str
    version: str | None

    @property
    def package(self) -> Path:
        return self.root / "sglang"


def _read_version(package: Path) -> str | None:
    """``sglang/_version.py``'s ``__version__`` read as text (the package is not imported)."""
    path = package / "_version.py"
    if not path.is_file():
        return None
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", path.read_text())
    return m.group(1) if m else None


def find_sglang_root() -> SglangTree | None:
    """The sglang package tree to load peers from, or ``None`` when there is none.

    Raises
    ------
    ValueError
        ``NSA_BACKEND_BENCH_SGLANG_ROOT`` is set but holds no ``sglang/__init__.py``.
    """
    env = os.environ.get(SGLANG_ROOT_ENV)
    if env:
        root = Path(env).expanduser()
        if not (root / "sglang" / "__init__.py").is_file():
            raise ValueError(f"{SGLANG_ROOT_ENV}: expected a directory containing the sglang/ package "
                             f"(sglang/__init__.py), got {env!r}")
        return SglangTree(root.resolve(), f"{SGLANG_ROOT_ENV}={env}", _read_version(root / "sglang"))
    try:
        spec = importlib.util.find_spec("sglang")  # a top-level package is located, not run
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    return SglangTree(package.parent.resolve(), "installed sglang", _read_version(package))


def _source(tree: SglangTree, relpath: str) -> tuple[Path, ast.Module]:
    path = tree.package / relpath
    if not path.is_file():
        raise PeerUnavailable(f"sglang/{relpath} is not in {tree.root}")
    return path, ast.parse(path.read_text(), str(path))


def _module_level_imports(module: ast.Module) -> set[str]:
    """Top-level package names imported at module level (inside top-level ``if`` / ``try`` too);
    a relative import counts as ``"."``."""
    names: set[str] = set()
    stack = list(module.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            stack.extend(h for handler in getattr(node, "handlers", []) for h in handler.body)
    return names


_MODULES: dict[tuple[Path, str], ModuleType] = {}


def _private_name(tree: SglangTree, relpath: str) -> str:
    digest = hashlib.sha1(str(tree.root).encode()).hexdigest()[:8]
    return f"_nsa_backend_peer_{digest}_" + re.sub(r"\W", "_", relpath.removesuffix(".py"))


def load_file_module(tree: SglangTree, relpath: str) -> ModuleType:
    """Load ``sglang/<relpath>`` by path as a private module (cached per tree).

    Raises
    ------
    PeerUnavailable
        The file is missing or imports something outside :data:`ALLOWED_MODULE_IMPORTS` at module level.
    """
    key = (tree.root, relpath)
    if key in _MODULES:
        return _MODULES[key]
    path, module_ast = _source(tree, relpath)
    extra = _module_level_imports(module_ast) - ALLOWED_MODULE_IMPORTS
    if extra:
        raise PeerUnavailable(f"sglang/{relpath} imports {sorted(extra)} at module level")
    name = _private_name(tree, relpath)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PeerUnavailable(f"sglang/{relpath}: no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton's JIT and autotuner look their functions' module up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    _MODULES[key] = module
    return module


def _assigned_names(node: ast.stmt) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _free_globals(table: symtable.SymbolTable) -> set[str]:
    out = set(table.get_globals()) if isinstance(table, symtable.Function) else set()
    for child in table.get_children():
        out |= _free_globals(child)
    return out


def load_functions(tree: SglangTree, relpath: str, names: tuple[str, ...],
                   constants: tuple[str, ...] = ()) -> dict[str, Callable[..., Any]]:
    """Compile the module-level functions ``names`` (and the simple assignments of ``constants``) of
    ``sglang/<relpath>`` from its syntax tree alone, with :data:`FUNCTION_GLOBALS` as their globals.

    Raises
    ------
    PeerUnavailable
        The file or a function is missing, a function is decorated, or a function reads a global that
        is neither supplied nor defined beside it.
    """
    path, module_ast = _source(tree, relpath)
    future = [n for n in module_ast.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    picked: list[ast.stmt] = []
    found: set[str] = set()
    for node in module_ast.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            if node.decorator_list:
                raise PeerUnavailable(f"sglang/{relpath}: {node.name} is decorated; not loadable on its own")
            picked.append(node)
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            assigned = _assigned_names(node)
            if assigned and assigned <= set(constants):
                picked.append(node)
                found |= assigned
    missing = [n for n in (*names, *constants) if n not in found]
    if missing:
        raise PeerUnavailable(f"sglang/{relpath} defines no module-level {missing}")
    body = ast.Module(body=future + picked, type_ignores=[])
    table = symtable.symtable(ast.unparse(body), str(path), "exec")
    known = set(FUNCTION_GLOBALS) | set(dir(builtins)) | found
    unknown = sorted(_free_globals(table) - known)
    if unknown:
        raise PeerUnavailable(f"sglang/{relpath}: {list(names)} read module globals {unknown} "
                              "that are not loadable without importing sglang")
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": _private_name(tree, relpath),
                                 **FUNCTION_GLOBALS}
    exec(compile(body, str(path), "exec"), namespace)  # the installed file's own code, line numbers kept
    return {n: namespace[n] for n in names}


# ----------------------------------------------------------------------------------------------
# The peers and their adapters to our ops' contracts
# ----------------------------------------------------------------------------------------------

DECODE_TRITON_FILE = "kernels/ops/attention/flash_mla_sm120_triton.py"
DECODE_TORCH_FILE = "kernels/ops/attention/flash_mla_sm120.py"
INDEXER_V4_FILE = "srt/layers/attention/dsv4/indexer.py"
INDEXER_DSA_FILE = "srt/layers/attention/dsa/utils.py"
# Module constants of flash_mla_sm120.py that its torch decode reads.
DECODE_TORCH_CONSTANTS = ("_NOPE_DIM", "_ROPE_DIM", "_NOPE_ROPE_STRIDE", "_TILE_SIZE", "_NUM_TILES",
                          "_SCALE_STRIDE", "_D")

# (op, impl) -> "sglang/<file>::<function>" of every peer.
PEERS: dict[tuple[str, str], str] = {
    ("sparse_mla_decode", "sglang_sm120_triton"): f"sglang/{DECODE_TRITON_FILE}::flash_mla_sparse_decode_triton",
    ("sparse_mla_decode", "sglang_sm120_torch"): f"sglang/{DECODE_TORCH_FILE}::_sm120_sparse_decode_fwd",
    ("fp8_paged_mqa_logits", "sglang_torch_sm120"): f"sglang/{INDEXER_V4_FILE}::fp8_paged_mqa_logits_torch_sm120",
    ("fp8_paged_mqa_logits", "sglang_torch"): f"sglang/{INDEXER_V4_FILE}::fp8_paged_mqa_logits_torch",
    ("fp8_mqa_logits", "sglang_torch"): f"sglang/{INDEXER_DSA_FILE}::_fp8_mqa_logits_torch",
}

DecodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _check_v4_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                          extra_kv_cache: torch.Tensor, extra_indices: torch.Tensor) -> None:
    """The part of our V4 decode contract SGLang's SM120 decode takes: ``s_q = 1``, 4-D caches of
    584-byte tokens whose pages are ``[P x 576 data][P x 8 scales]`` at ``stride(0)``."""
    if q.dim() != 4 or q.shape[1] != 1 or q.shape[3] != 512 or q.dtype != torch.bfloat16:
        raise ValueError(f"q: expected bfloat16 [B, 1, h_q, 512] (SGLang's SM120 decode takes s_q = 1), "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, cache, idx in (("kv_cache", kv_cache, indices), ("extra_kv_cache", extra_kv_cache, extra_indices)):
        if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[2:] != (1, 584):
            raise ValueError(f"{name}: expected uint8 [num_blocks, page_size, 1, 584], got {cache.dtype} "
                             f"{tuple(cache.shape)}")
        if cache.stride(0) < cache.shape[1] * 584 or cache.stride(1) != 584:
            raise ValueError(f"{name}: expected block-split pages ({cache.shape[1]} x 584 bytes at stride(0)), "
                             f"got strides {cache.stride()}")
        prefix = "extra_" if name.startswith("extra") else ""
        if idx.dtype != torch.int32 or idx.dim() != 3 or idx.shape[:2] != q.shape[:2]:
            raise ValueError(f"{prefix}indices: expected int32 [B, 1, topk], got {idx.dtype} {tuple(idx.shape)}")


def v4_decode_triton(tree: SglangTree) -> DecodeFn:
    """``sglang_sm120_triton`` with our V4 decode arguments.

    Returns ``fn(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
    sm_scale) -> (out [B, 1, h_q, 512] bf16, lse [B, h_q, 1] f32)``: our ``sparse_mla_decode`` with
    ``kv_format="fp8_ds_mla_v4"``, ``s_q = 1``, ``d_v = 512``, no sink. Our cache bytes are SGLang's V4
    pages as they are (same block-split layout, ``stride(0)`` read as the page size in bytes), so the
    adapter passes the tensors through; SGLang's LSE of a row without keys is ``-inf`` where ours is ``+inf``.
    Under ``TRITON_INTERPRET=1`` the kernel's autotuner keeps its first config only.
    """
    module = load_file_module(tree, DECODE_TRITON_FILE)
    fn = module.flash_mla_sparse_decode_triton
    if os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's interpreter has no GPU driver to benchmark autotune configs with; an autotuner with a
        # single config runs it without benchmarking. The module is our private copy, not sglang's.
        kernel = module._tiled_sparse_decode_kernel
        kernel.configs = kernel.configs[:1]

    def call(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length, sm_scale):
        _check_v4_decode_args(q, kv_cache, indices, extra_kv_cache, extra_indices)
        return fn(q, kv_cache, indices, topk_length, None, 512, sm_scale, extra_kv_cache, extra_indices,
                  extra_topk_length)

    return call


def v4_decode_torch(tree: SglangTree) -> DecodeFn:
    """``sglang_sm120_torch`` with the arguments of :func:`v4_decode_triton` (same returns)."""
    fn = load_functions(tree, DECODE_TORCH_FILE, ("_sm120_sparse_decode_fwd", "_gather_and_dequant"),
                        DECODE_TORCH_CONSTANTS)["_sm120_sparse_decode_fwd"]

    def call(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length, sm_scale):
        _check_v4_decode_args(q, kv_cache, indices, extra_kv_cache, extra_indices)
        return fn(q, kv_cache, indices, topk_length, None, 512, sm_scale, extra_kv_cache, extra_indices,
                  extra_topk_length)

    return call


PagedFn = Callable[..., torch.Tensor]


def paged_logits(tree: SglangTree, impl: str) -> PagedFn:
    """``sglang_torch_sm120`` or ``sglang_torch`` (``impl``) with our ``fp8_paged_mqa_logits`` arguments.

    Returns ``fn(q [B, 1, H, 128] fp8, kv_cache [P, 64, 1, 132] uint8, weights [B, H] f32,
    context_lens [B] i32, block_table [B, n] i32, max_context_len) -> [B, max_context_len] f32``. The
    cache is DeepGEMM's page layout (``[64 x 128 e4m3][64 x f32 scales]``), ours and SGLang's alike; the
    schedule metadata is unused by SGLang's torch code. Outside ``[0, context_lens[b])`` SGLang writes
    ``-inf`` (``_sm120``) or ``0``, ours is unspecified: compare inside only.
    """
    name = {"sglang_torch_sm120": "fp8_paged_mqa_logits_torch_sm120",
            "sglang_torch": "fp8_paged_mqa_logits_torch"}.get(impl)
    if name is None:
        raise ValueError(f"impl: expected 'sglang_torch_sm120' or 'sglang_torch', got {impl!r}")
    fn = load_functions(tree, INDEXER_V4_FILE, (name,), ("_arange_cache",))[name]

    def call(q, kv_cache, weights, context_lens, block_table, max_context_len):
        if q.dim() != 4 or q.shape[1] != 1:
            raise ValueError(f"q: expected [B, 1, H, D] (SGLang's torch paged logits take next_n = 1), "
                             f"got {tuple(q.shape)}")
        if context_lens.dim() != 1:
            raise ValueError(f"context_lens: expected [B] (1-D), got {tuple(context_lens.shape)}")
        return fn(q, kv_cache, weights, context_lens, block_table, None, max_context_len, clean_logits=False)

    return call


def ragged_logits(tree: SglangTree) -> Callable[..., torch.Tensor]:
    """``sglang_torch`` for ``fp8_mqa_logits``: ``fn(q [S, H, D] fp8, (k [N, D] fp8, k_scale [N] f32),
    weights [S, H] f32, ks [S] i32, ke [S] i32) -> [S, N] f32`` (``0`` outside ``[ks, ke)``, where ours
    is ``-inf``)."""
    fn = load_functions(tree, INDEXER_DSA_FILE, ("_fp8_mqa_logits_torch",))["_fp8_mqa_logits_torch"]

    def call(q, kv, weights, ks, ke):
        return fn(q, kv, weights, ks, ke, clean_logits=False)

    return call
