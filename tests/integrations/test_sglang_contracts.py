"""Call-site contracts with the installed SGLang release.

nsa-backend patches, wraps or subclasses SGLang functions and methods. For each of them, every call site
in SGLang's installed source (found by walking the package directory with ``ast``) is bound to our
signature with ``inspect.Signature.bind``: the positional count and the keyword names, with the keys of
a ``**name`` argument read from the dict that name is built as in the same function (literal, ``dict(..)``,
``name["k"] = ..``, ``name.update(..)``; keys of a pass-through ``**kwargs`` parameter are not known
statically). A failure names ``file:line``. Our overriding methods must also accept every call their
base class signature accepts.
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
from sglang.srt.arg_groups import model_hook, resolution_hooks
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.layers.attention.dsa_backend import (
    DeepseekSparseAttnBackend,
    DeepseekSparseAttnMultiStepBackend,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_utils import DraftBackendFactory

from nsa_backend_integrations.sglang import kernels, plugin
from nsa_backend_integrations.sglang.backend import (
    NsaIndexerMetadata,
    NsaSparseAttnBackend,
    NsaSparseAttnMultiStepBackend,
)

SGLANG_DIR = os.path.dirname(sglang.__file__)


@dataclass
class Site:
    path: str
    line: int
    positional: int | None  # None: a *starred argument
    keywords: set[str]

    def where(self) -> str:
        return f"{os.path.relpath(self.path, os.path.dirname(SGLANG_DIR))}:{self.line}"


def _dict_keys(node: ast.AST) -> set[str] | None:
    if isinstance(node, ast.Dict):
        if any(k is None or not isinstance(k, ast.Constant) for k in node.keys):
            return None
        return {k.value for k in node.keys}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {kw.arg for kw in node.keywords if kw.arg is not None}
    if isinstance(node, ast.IfExp):
        a, b = _dict_keys(node.body), _dict_keys(node.orelse)
        return None if a is None or b is None else a | b
    return None


def _local_dict_keys(func: ast.AST, name: str) -> set[str]:
    """Keys a local dict ``name`` gets anywhere in ``func``."""
    keys: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    keys |= _dict_keys(node.value) or set()
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == name
                    and isinstance(target.slice, ast.Constant)
                ):
                    keys.add(target.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name
        ):
            keys |= {kw.arg for kw in node.keywords if kw.arg}
            for arg in node.args:
                keys |= _dict_keys(arg) or set()
    return keys


# Names whose call sites are looked up; a file that mentions none of them is not parsed.
NAMES = (
    "_create_backend", "check_server_args", "attn_mqa", "DeepseekSparseAttn", "topk_transform",
    "get_indexer_metadata", "get_topk_transform_method", "set_dsa_prefill_impl", "_topk_v2_plan",
    "forward_extend", "forward_decode", "mqa_logits", "tf32_hc_prenorm_gemm", "run_hook",
    "handle_model_specific_adjustments",
)


@functools.cache
def _trees() -> list[tuple[str, ast.AST]]:
    out = []
    for root, _, files in os.walk(SGLANG_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    if any(n in text for n in NAMES):
                        out.append((path, ast.parse(text, path)))
                except (SyntaxError, UnicodeDecodeError):
                    continue
    return out


def _calls_in(node: ast.AST, func: ast.AST | None, out: list, path: str) -> None:
    for child in ast.iter_child_nodes(node):
        inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
        if isinstance(child, ast.Call):
            out.append((path, child, inner))
        _calls_in(child, inner, out, path)


@functools.cache
def _all_calls() -> list[tuple[str, ast.Call, ast.AST | None]]:
    calls: list = []
    for path, tree in _trees():
        _calls_in(tree, None, calls, path)
    return calls


def call_sites(
    name: str,
    attribute_only: bool = False,
    receivers: tuple[str, ...] = (),
    receiver_filter: Callable[[str, str], bool] | None = None,
) -> list[Site]:
    """Calls of ``name`` (``x.name(..)``, or ``name(..)`` unless ``attribute_only``) in SGLang's source.

    ``receivers``: only ``r.name(..)`` for these receiver names (and bare ``name(..)``);
    ``receiver_filter(path, receiver source)``: keep an attribute call when true."""
    sites = []
    for path, call, func in _all_calls():
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == name:
            if receivers and not (isinstance(f.value, ast.Name) and f.value.id in receivers):
                continue
            if receiver_filter is not None and not receiver_filter(path, ast.unparse(f.value)):
                continue
        elif not (isinstance(f, ast.Name) and f.id == name and not attribute_only):
            continue
        starred = any(isinstance(a, ast.Starred) for a in call.args)
        keywords: set[str] = set()
        for kw in call.keywords:
            if kw.arg is not None:
                keywords.add(kw.arg)
            elif isinstance(kw.value, ast.Name) and func is not None:
                keywords |= _local_dict_keys(func, kw.value.id)
            else:
                keywords |= _dict_keys(kw.value) or set()
        sites.append(Site(path, call.lineno, None if starred else len(call.args), keywords))
    return sites


def bind_all(sites: list[Site], target: Callable, insert_at: int | None = None) -> int:
    """Bind every site to ``target``'s signature; ``insert_at``: a positional the callee adds (``layer``)."""
    sig = inspect.signature(target)
    failures = []
    for site in sites:
        n = site.positional
        if n is None:  # *args: only the keywords are checked
            params = list(sig.parameters.values())
            names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            extra = any(p.kind == p.VAR_KEYWORD for p in params)
            bad = set() if extra else site.keywords - names
            if bad:
                failures.append(f"{site.where()}: keywords {sorted(bad)} not accepted")
            continue
        if insert_at is not None and n >= insert_at:
            n += 1
        try:
            sig.bind(*range(n), **{k: None for k in site.keywords})
        except TypeError as exc:
            failures.append(f"{site.where()}: {n} positional + {sorted(site.keywords)}: {exc}")
    assert not failures, f"{getattr(target, '__qualname__', target)}:\n" + "\n".join(failures)
    return len(sites)


def _unbound(fn: Callable) -> Callable:
    """``fn(self, ...)`` as called through an instance."""
    return functools.partial(fn, None)


BOUND: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    plugin.register()
    yield
    total = sum(BOUND.values())
    print(f"\nSGLang {sglang.__version__}: {total} call sites bound: {BOUND}")


def test_draft_backend_factory_create_backend():
    wrapper = DraftBackendFactory._create_backend
    assert getattr(wrapper, "__wrapped__", None) is not None
    sites = call_sites("_create_backend", attribute_only=True)
    assert sites, "DraftBackendFactory._create_backend has no call site"
    BOUND["DraftBackendFactory._create_backend"] = bind_all(sites, _unbound(wrapper))


def test_check_server_args():
    sites = call_sites("check_server_args", attribute_only=True)
    assert sites
    BOUND["ServerArgs.check_server_args"] = bind_all(sites, _unbound(ServerArgs.check_server_args))


@pytest.mark.parametrize("name", kernels.RESOLVERS)
def test_dsa_resolvers(name):
    sites = call_sites(name)
    assert sites, f"{name} has no call site"
    BOUND[name] = bind_all(sites, kernels._resolver(name))


@pytest.mark.parametrize("name", kernels.DEEP_GEMM_FUNCTIONS)
def test_deep_gemm_functions(name):
    """Calls through the ``deep_gemm`` module and through a resolved DSA function (``fn``, ``*_fn``)."""
    sites = call_sites(name, attribute_only=True, receivers=("deep_gemm",))
    resolved = {
        "fp8_mqa_logits": "resolve_fp8_mqa_logits_fn",
        "fp8_paged_mqa_logits": "resolve_fp8_paged_mqa_logits_fn",
        "get_paged_mqa_logits_metadata": "resolve_paged_mqa_logits_metadata_fn",
    }.get(name)
    if resolved is not None:
        sites += _calls_of_resolved(resolved)
    assert sites, f"{name} has no call site"
    BOUND[f"deep_gemm.{name}"] = bind_all(sites, kernels.ROUTED[name])


def _calls_of_resolved(resolver: str) -> list[Site]:
    """Calls of a variable assigned from ``resolver()`` (``fn = resolve_x(); fn(...)``) or ``resolve_x()(...)``."""
    sites = []
    for path, call, func in _all_calls():
        f = call.func
        direct = isinstance(f, ast.Call) and isinstance(f.func, (ast.Name, ast.Attribute))
        if direct and getattr(f.func, "id", getattr(f.func, "attr", None)) == resolver:
            pass
        elif isinstance(f, ast.Name) and func is not None:
            assigned = False
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == f.id for t in node.targets)
                    and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == resolver
                ):
                    assigned = True
            if not assigned:
                continue
        else:
            continue
        keywords = {kw.arg for kw in call.keywords if kw.arg}
        starred = any(isinstance(a, ast.Starred) for a in call.args)
        sites.append(Site(path, call.lineno, None if starred else len(call.args), keywords))
    return sites


def _resolution_wrapper() -> Callable:
    """The plugin's wrapper registered for SGLang's ``handle_model_specific_adjustments`` step."""
    assert plugin.RESOLUTION_STEP in resolution_hooks._OVERRIDABLE_HOOKS, (
        f"{plugin.RESOLUTION_STEP} is not an overridable resolution step of SGLang {sglang.__version__}"
    )
    ours = [fn for fn in resolution_hooks._HOOKS.get(plugin.RESOLUTION_STEP, ()) if getattr(fn, plugin._MARK, False)]
    assert len(ours) == 1, f"{len(ours)} nsa-backend wrappers registered for {plugin.RESOLUTION_STEP}"
    return ours[0]


def _calls_in_function(file_suffix: str, function: str, callee: str) -> list[Site]:
    """Calls ``callee(..)`` made inside ``def function`` (nested definitions included) of the SGLang file
    whose path ends with ``file_suffix``."""
    sites = []
    for path, tree in _trees():
        if not path.endswith(file_suffix):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == callee:
                    starred = any(isinstance(a, ast.Starred) for a in call.args)
                    keywords = {kw.arg for kw in call.keywords if kw.arg}
                    sites.append(Site(path, call.lineno, None if starred else len(call.args), keywords))
    return sites


def test_resolution_hook_call_sites():
    """Every way SGLang's resolution reaches the plugin's wrapper of ``handle_model_specific_adjustments``.

    - each ``run_hook(handle_model_specific_adjustments, ...)`` of the pipeline: bound to ``run_hook``,
      and its step arguments (the builtin replaced by ``previous``) to our ``(server_args, previous)``;
    - ``resolution_hooks._bind``'s ``fn(server_args, previous)``: bound to our wrapper;
    - no direct call of the step outside ``run_hook`` (it would skip the wrapper);
    - our ``previous(server_args)``: bound to SGLang's own step.
    """
    wrapper = _resolution_wrapper()
    run_hook_sites = []
    for path, call, _func in _all_calls():
        f = call.func
        if not (isinstance(f, ast.Name) and f.id == "run_hook") or not call.args:
            continue
        first = call.args[0]
        if getattr(first, "id", getattr(first, "attr", None)) == plugin.RESOLUTION_STEP:
            starred = any(isinstance(a, ast.Starred) for a in call.args)
            keywords = {kw.arg for kw in call.keywords if kw.arg}
            run_hook_sites.append(Site(path, call.lineno, None if starred else len(call.args), keywords))
    assert run_hook_sites, (
        f"no run_hook({plugin.RESOLUTION_STEP}, ...) in SGLang {sglang.__version__}: the wrapper never runs"
    )
    bind_all(run_hook_sites, resolution_hooks.run_hook)
    # run_hook(builtin, server_args) -> the wrapper gets (server_args, previous): same positional count
    BOUND[f"run_hook({plugin.RESOLUTION_STEP}) -> resolve_dsa_phases"] = bind_all(run_hook_sites, wrapper)
    bind_sites = _calls_in_function("arg_groups/resolution_hooks.py", "_bind", "fn")
    assert bind_sites, "resolution_hooks._bind calls no fn(...): the wrapper protocol changed"
    BOUND["resolution_hooks._bind fn(...) -> resolve_dsa_phases"] = bind_all(bind_sites, wrapper)
    direct = call_sites(plugin.RESOLUTION_STEP)
    assert not direct, "called without run_hook (skips nsa-backend's wrapper): " + ", ".join(
        site.where() for site in direct
    )
    # What the wrapper calls: previous(server_args), SGLang's step when ours is the first wrapper.
    inspect.signature(model_hook.handle_model_specific_adjustments).bind(None)


OVERRIDES = [
    (NsaSparseAttnBackend, DeepseekSparseAttnBackend),
    (NsaSparseAttnMultiStepBackend, DeepseekSparseAttnMultiStepBackend),
    (NsaIndexerMetadata, DSAIndexerMetadata),
]


def reaches_dsa(path: str, receiver: str) -> bool:
    """A call that can reach SGLang's DSA backend / indexer metadata (or ours in their place): made on
    an attention backend (``...attn_backend``, a hybrid / TBO wrapper's children), inside the DSA
    modules (``self`` / ``super()`` / metadata objects there), or by the DeepSeek model code. Methods
    of other classes that share a name (Llama's ``self.attn.forward_decode``, MiniMax's backend, a
    hybrid backend's linear-attention half, ``DSATopKBackend.topk_transform``, the ROCm gfx950
    indexer) are left out."""
    rel = os.path.relpath(path, SGLANG_DIR)
    if "gfx950" in rel or "hip" in rel.split(os.sep)[-1]:
        return False
    if receiver.endswith(("linear_attn_backend", "topk_backend")):  # a GDN backend, SGLang's top-k kernels
        return False
    if "backend" in receiver.split(".")[-1] or receiver.endswith("]"):
        return "attention" in rel or "model_executor" in rel or "speculative" in rel or "dsa" in rel
    return "dsa" in rel or "deepseek" in rel


def _overridden(ours: type, base: type) -> list[str]:
    return sorted(
        name
        for name, value in vars(ours).items()
        if callable(value) and hasattr(base, name) and name != "__init__" and not name.startswith("__")
    )


@pytest.mark.parametrize("ours,base", OVERRIDES, ids=[o.__name__ for o, _ in OVERRIDES])
def test_overrides_bind_every_call_site(ours, base):
    names = _overridden(ours, base)
    assert names or ours is NsaSparseAttnMultiStepBackend
    for name in names:
        sites = call_sites(name, attribute_only=True, receiver_filter=reaches_dsa)
        assert sites, f"{base.__name__}.{name} has no call site"
        BOUND[f"{ours.__name__}.{name}"] = bind_all(sites, _unbound(getattr(ours, name)))
    # Construction: SGLang builds its own class; our factories build ours with the same arguments.
    sites = call_sites(base.__name__)
    BOUND[f"{ours.__name__}.__init__"] = bind_all(sites, _unbound(ours.__init__))


def test_model_attention_calls_bind_forward():
    """The DeepSeek MLA forward calls ``self.attn_mqa(q, k, v, forward_batch, **kw)`` (RadixAttention),
    which hands ``q, k, v, layer, forward_batch`` and the keywords to the backend's forward_*."""
    sites = call_sites("attn_mqa", attribute_only=True) + call_sites(
        "attn_mqa_for_dcp_decode", attribute_only=True
    )
    assert sites and any("cos_sin_cache" in s.keywords for s in sites)
    for name in ("forward_extend", "forward_decode"):
        BOUND[f"attn_mqa -> NsaSparseAttnBackend.{name}"] = bind_all(
            sites, _unbound(getattr(NsaSparseAttnBackend, name)), insert_at=3
        )


@pytest.mark.parametrize("ours,base", OVERRIDES, ids=[o.__name__ for o, _ in OVERRIDES])
def test_overrides_accept_base_signature(ours, base):
    for name in [*_overridden(ours, base), "__init__"]:
        mine = inspect.signature(getattr(ours, name))
        theirs = inspect.signature(getattr(base, name))
        mine_params = list(mine.parameters.values())
        var_pos = any(p.kind == p.VAR_POSITIONAL for p in mine_params)
        var_kw = any(p.kind == p.VAR_KEYWORD for p in mine_params)
        positional = [p for p in mine_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for i, p in enumerate(theirs.parameters.values()):
            where = f"{ours.__name__}.{name} vs {base.__name__}.{name}: parameter {p.name!r}"
            if p.kind in (p.VAR_POSITIONAL,):
                assert var_pos, where + " (*args)"
            elif p.kind == p.VAR_KEYWORD:
                assert var_kw, where + " (**kwargs)"
            elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                if i < len(positional):
                    assert positional[i].name == p.name or var_kw, where + f" is {positional[i].name!r} here"
                    if p.default is not p.empty:
                        assert positional[i].default is not p.empty, where + " needs a default"
                else:
                    assert var_pos and var_kw, where + " missing"
            else:
                assert p.name in mine.parameters or var_kw, where + " (keyword) missing"
