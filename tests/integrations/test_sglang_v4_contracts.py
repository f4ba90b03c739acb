"""Call-site contracts of the DeepSeek-V4 replacements with the installed SGLang release.

:mod:`nsa_backend_integrations.sglang.dsv4` replaces module functions SGLang looks up when it runs
(``flash_mla_interface.flash_mla_with_kvcache`` / ``flash_mla_sparse_fwd`` / ``get_mla_metadata``,
``flash_mla_sm120.flash_mla_with_kvcache_sm120``, the V4 pool's ``fused_store_cache``, DeepGEMM's MXFP4
indexer functions). The replacement is module-wide, so every call site in SGLang's installed source
(found with ``ast``) is bound to the replacement's signature with ``inspect.Signature.bind``, and each
replacement accepts every call SGLang's original accepts (its signature read from the source file,
since FlashMLA's library does not load without CUDA). The lookup kind of each site (attribute read at
call time, ``from x import f`` inside the calling function, or a module-level import whose global is
replaced) is checked too: a module-level ``from x import f`` elsewhere would keep SGLang's function.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.importorskip("sglang")

import sglang

from nsa_backend_integrations.sglang import dsv4

SGLANG_DIR = os.path.dirname(sglang.__file__)
NAMES = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "flash_mla_with_kvcache_sm120",
         "fused_store_cache", "fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits")
# The SGLang file defining each replaced function, relative to the package.
DEFINED_IN = {
    "flash_mla_with_kvcache": "kernels/ops/attention/flash_mla_interface.py",
    "flash_mla_sparse_fwd": "kernels/ops/attention/flash_mla_interface.py",
    "get_mla_metadata": "kernels/ops/attention/flash_mla_interface.py",
    "flash_mla_with_kvcache_sm120": "kernels/ops/attention/flash_mla_sm120.py",
    "fused_store_cache": "kernels/ops/attention/dsv4/attn.py",
}
REPLACEMENT = {attr: fn for (_, attr), fn in dsv4.REPLACEMENTS.items()} | dsv4.DEEP_GEMM_V4_FUNCTIONS


@dataclass
class Site:
    path: str
    line: int
    positional: int | None  # None: a *starred argument
    keywords: set[str]
    starstar: bool  # a **kwargs argument whose keys are not known statically

    def where(self) -> str:
        return f"{os.path.relpath(self.path, os.path.dirname(SGLANG_DIR))}:{self.line}"


@functools.cache
def _trees() -> tuple[tuple[str, ast.Module], ...]:
    out = []
    for root, _, files in os.walk(SGLANG_DIR):
        if os.sep + "test" in root[len(SGLANG_DIR):]:
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if any(n in text for n in NAMES):
                out.append((path, ast.parse(text, path)))
    return tuple(out)


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _aliases(func: ast.AST, name: str) -> set[str]:
    """Local names ``name`` is imported as inside ``func`` (``from x import name as fn``)."""
    out = set()
    for node in ast.walk(func):
        if isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names if a.name == name}
    return out


def _site(path: str, call: ast.Call, extra_keywords: set[str] = frozenset()) -> Site:
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    keywords = {kw.arg for kw in call.keywords if kw.arg} | set(extra_keywords)
    starstar = any(kw.arg is None for kw in call.keywords)
    return Site(path, call.lineno, None if starred else len(call.args), keywords, starstar)


def call_sites(name: str) -> list[Site]:
    """Calls of ``name``: ``x.name(..)``, ``name(..)``, ``alias(..)`` of ``from .. import name as alias``, and
    calls of an attribute bound to ``functools.partial(x.name, **kw)`` (the partial's keywords added)."""
    sites = []
    for path, tree in _trees():
        partial_attrs: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func).endswith("partial") and node.value.args
                    and ast.unparse(node.value.args[0]).split(".")[-1] == name):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        partial_attrs[target.attr] = {kw.arg for kw in node.value.keywords if kw.arg}
        for func in [tree, *_functions(tree)]:
            local = {name} | (_aliases(func, name) if func is not tree else set())
            # locals assigned from a partial attribute (``f = self._partial``)
            bound: dict[str, set[str]] = {}
            for node in ast.walk(func):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                        and node.value.attr in partial_attrs):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            bound[target.id] = partial_attrs[node.value.attr]
            for call in ast.walk(func):
                if not isinstance(call, ast.Call):
                    continue
                f = call.func
                if isinstance(f, ast.Attribute) and f.attr == name:
                    # FlashMLA's own package (``flash_mla.x``), called by SGLang's interface, is not replaced
                    if not (isinstance(f.value, ast.Name) and f.value.id == "flash_mla"):
                        sites.append(_site(path, call))
                elif isinstance(f, ast.Attribute) and f.attr in partial_attrs:
                    sites.append(_site(path, call, partial_attrs[f.attr]))
                elif isinstance(f, ast.Name) and f.id in local | set(bound):
                    sites.append(_site(path, call, bound.get(f.id, set())))
    # A call inside nested functions is seen from each enclosing function: keep one per location.
    unique = {(s.path, s.line): s for s in sites}
    return sorted(unique.values(), key=lambda s: (s.path, s.line))


def bind_all(sites: list[Site], target: Callable) -> int:
    sig = inspect.signature(target)
    params = list(sig.parameters.values())
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    failures = []
    for site in sites:
        if site.positional is None or site.starstar:  # *args / **kwargs: only the named keywords are checked
            bad = set() if var_kw else site.keywords - names
            if bad:
                failures.append(f"{site.where()}: keywords {sorted(bad)} not accepted")
            continue
        try:
            sig.bind(*range(site.positional), **{k: None for k in site.keywords})
        except TypeError as exc:
            failures.append(f"{site.where()}: {site.positional} positional + {sorted(site.keywords)}: {exc}")
    assert not failures, f"{target.__qualname__}:\n" + "\n".join(failures)
    return len(sites)


@pytest.mark.parametrize("name", NAMES)
def test_every_call_site_binds_to_replacement(name):
    sites = call_sites(name)
    assert sites, f"{name} has no call site in SGLang {sglang.__version__}"
    assert bind_all(sites, REPLACEMENT[name]) == len(sites)


def test_dsv4_backend_call_sites_found():
    """The V4 backend's own calls are among the bound sites (the walk would otherwise prove nothing)."""
    backend = "srt/layers/attention/deepseek_v4_backend.py"
    for name in ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "flash_mla_with_kvcache_sm120", "get_mla_metadata"):
        assert any(s.path.endswith(backend) for s in call_sites(name)), f"{name}: no call in {backend}"
    decode = [s for s in call_sites("flash_mla_with_kvcache") if s.path.endswith(backend)]
    # through the partial of __init__: its use_legacy keyword rides on the call
    assert any("use_legacy" in s.keywords and "extra_indices_in_kvcache" in s.keywords for s in decode)
    pool = [s for s in call_sites("fused_store_cache") if s.path.endswith("mem_cache/deepseek_v4_memory_pool.py")]
    assert pool and all({"page_size", "type"} <= s.keywords for s in pool)
    fp4 = [s for s in call_sites("fp8_fp4_paged_mqa_logits") if s.path.endswith("attention/dsv4/indexer.py")]
    assert any(s.positional == 8 for s in fp4), "the V4 indexer's fn(..) call with clean_logits positional"


def _ast_signature(relpath: str, name: str) -> inspect.Signature:
    path = os.path.join(SGLANG_DIR, relpath)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    a = node.args
    params = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        default = None if i >= first_default else inspect.Parameter.empty
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if default is None else None))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_replacement_accepts_sglang_signature(name):
    """Same positional names in the same order, a default wherever SGLang has one, every keyword-only name."""
    theirs = _ast_signature(DEFINED_IN[name], name)
    mine = inspect.signature(REPLACEMENT[name])
    mine_params = list(mine.parameters.values())
    positional = [p for p in mine_params if p.kind == p.POSITIONAL_OR_KEYWORD]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in mine_params)
    for i, p in enumerate(theirs.parameters.values()):
        where = f"{name}: SGLang parameter {p.name!r}"
        if p.kind == p.VAR_KEYWORD:
            assert var_kw, where
        elif p.kind == p.POSITIONAL_OR_KEYWORD:
            assert i < len(positional) and positional[i].name == p.name, where + " not at the same position"
            if p.default is not p.empty:
                assert positional[i].default is not p.empty, where + " needs a default"
        elif p.kind == p.KEYWORD_ONLY:
            assert p.name in mine.parameters or var_kw, where + " (keyword-only) missing"


def test_deep_gemm_signatures_accepted():
    deep_gemm = pytest.importorskip("deep_gemm")
    for name, fn in dsv4.DEEP_GEMM_V4_FUNCTIONS.items():
        original = dsv4._ORIGINALS.get(("deep_gemm", name), getattr(deep_gemm, name))
        theirs = inspect.signature(getattr(original, "__wrapped__", original))
        assert list(inspect.signature(fn).parameters)[: len(theirs.parameters)] == list(theirs.parameters), name


def _imports_of(relpath: str, name: str) -> list[tuple[bool, str]]:
    """``(inside a function, module)`` of every ``from module import name`` in an SGLang file."""
    path = os.path.join(SGLANG_DIR, relpath)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    inner = {id(n) for fn in _functions(tree) for n in ast.walk(fn)}
    return [(id(node) in inner, node.module or "") for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names)]


def test_lookup_sites_are_replaceable():
    """Each name is read where a module-level replacement reaches it."""
    backend = "srt/layers/attention/deepseek_v4_backend.py"
    for name in ("flash_mla_sparse_fwd", "flash_mla_with_kvcache_sm120", "get_mla_metadata"):
        found = [(inside, mod) for inside, mod in _imports_of(backend, name) if "kernels.ops.attention" in mod]
        assert found and all(inside for inside, _ in found), f"{name}: imported at module level in {backend}"
    pool = "srt/mem_cache/deepseek_v4_memory_pool.py"
    assert (False, "sglang.kernels.ops.attention.dsv4.attn") in _imports_of(pool, "fused_store_cache") or any(
        not inside for inside, _ in _imports_of(pool, "fused_store_cache")), "the pool's import changed"


def test_activate_replaces_every_lookup(monkeypatch):
    import importlib
    import sys

    dsv4.deactivate()
    try:
        dsv4.activate()
        for (module_name, attr), fn in dsv4.REPLACEMENTS.items():
            assert getattr(sys.modules[module_name], attr) is fn, f"{module_name}.{attr} not replaced"
        # the backend's own import of the prefill function finds ours
        from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

        assert flash_mla_sparse_fwd is dsv4.flash_mla_sparse_fwd
        assert importlib.import_module(dsv4.V4_MEMORY_POOL).fused_store_cache is dsv4.fused_store_cache
    finally:
        dsv4.deactivate()
    assert sys.modules[dsv4.FLASH_MLA_SM120].flash_mla_with_kvcache_sm120 is not dsv4.flash_mla_with_kvcache_sm120
