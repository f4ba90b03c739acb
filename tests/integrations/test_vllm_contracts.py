"""Contract tests between nsa-backend's vLLM integration and the installed vLLM's own source.

Every vLLM function, class or registry entry that the integration replaces is called by vLLM code
we did not write. These tests read that code from the installed ``vllm`` package (``ast``), find
every call that reaches a replacement, and bind the call's positional count and keyword names to
the replacement's signature (:meth:`inspect.Signature.bind` with placeholders), so a vLLM release
that passes a new argument fails here, naming ``file:line``, instead of at the first forward.
They also check that each replacement's signature is a superset of the function it replaces, and
that the backend, metadata builder and impl classes have every method vLLM calls on its own
sparse-MLA classes with a compatible signature. They run in whichever vLLM is installed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from nsa_backend_integrations.vllm import backend as nsa_backend_vllm  # noqa: E402
from nsa_backend_integrations.vllm import indexer as nsa_indexer  # noqa: E402
from nsa_backend_integrations.vllm import mhc, plugin  # noqa: E402

VLLM_ROOT = Path(vllm.__file__).resolve().parent
_PLACEHOLDER = object()


# --- reading vLLM's source ------------------------------------------------------------------------


@functools.cache
def _sources() -> dict[Path, str]:
    """Text of every module of the installed vLLM package."""
    return {path: path.read_text(encoding="utf-8", errors="replace") for path in sorted(VLLM_ROOT.rglob("*.py"))}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(_sources()[path], filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(VLLM_ROOT.parent)}:{node.lineno}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(VLLM_ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@dataclass(frozen=True)
class CallSite:
    """One call in vLLM's source: where, how many positional arguments, which keyword names."""

    where: str
    num_positional: int
    keywords: tuple[str, ...]
    star_args: bool
    star_kwargs: bool


def _call_site(path: Path, call: ast.Call) -> CallSite:
    return CallSite(
        where=_where(path, call),
        num_positional=sum(not isinstance(a, ast.Starred) for a in call.args),
        keywords=tuple(k.arg for k in call.keywords if k.arg is not None),
        star_args=any(isinstance(a, ast.Starred) for a in call.args),
        star_kwargs=any(k.arg is None for k in call.keywords),
    )


def _imports_name(tree: ast.Module, module: str, name: str) -> list[tuple[ast.ImportFrom, str, bool]]:
    """``from module import name [as alias]`` statements of ``tree``: (node, local name, at module level)."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0:
            for alias in node.names:
                if alias.name == name:
                    found.append((node, alias.asname or name, id(node) in top))
    return found


def _module_aliases(tree: ast.Module, module: str) -> set[str]:
    """Local names bound to ``module`` itself (``import a.b as m``, ``from a import b``)."""
    parent, _, leaf = module.rpartition(".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname for alias in node.names if alias.name == module and alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == parent and node.level == 0:
            names.update(alias.asname or leaf for alias in node.names if alias.name == leaf)
    return names


def call_sites_of_module_attribute(module: str, name: str) -> list[CallSite]:
    """Every call in vLLM that looks ``name`` up in ``module`` when it runs, which is what a
    replaced module attribute reaches: bare calls in ``module`` itself, calls through a
    function-level ``from module import name`` and calls of ``<module alias>.name``."""
    sites = []
    for path, text in _sources().items():
        if name not in text:
            continue
        tree = _tree(path)
        own_module = _module_name(path) == module
        local_names = {alias for _, alias, _ in _imports_name(tree, module, name)}
        if own_module:
            local_names.add(name)
        aliases = _module_aliases(tree, module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in local_names:
                sites.append(_call_site(path, node))
            elif (
                isinstance(func, ast.Attribute)
                and func.attr == name
                and isinstance(func.value, ast.Name)
                and func.value.id in aliases
            ):
                sites.append(_call_site(path, node))
    return sites


def module_level_imports(module: str, name: str) -> list[str]:
    """``file:line`` of every module-level ``from module import name`` outside ``module``: such a
    binding is made at import time and does not see a later replacement of ``module.name``."""
    found = []
    for path, text in _sources().items():
        if name in text and _module_name(path) != module:
            found += [_where(path, node) for node, _, top in _imports_name(_tree(path), module, name) if top]
    return found


def files_importing(module: str, name: str) -> frozenset[Path]:
    """vLLM modules that import ``name`` from ``module`` (anywhere in the file)."""
    return frozenset(
        path for path, text in _sources().items() if name in text and _imports_name(_tree(path), module, name)
    )


@functools.cache
def call_sites_of_method(name: str, receiver: re.Pattern[str], files: frozenset[Path] | None = None) -> list[CallSite]:
    """Every ``<expr>.name(...)`` call in vLLM (in ``files``, when given) whose receiver's source
    text matches ``receiver``."""
    sites = []
    for path, text in _sources().items():
        if f".{name}(" not in text or (files is not None and path not in files):
            continue
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == name
                and receiver.search(ast.unparse(node.func.value))
                # ``SomeClass.method(...)`` names vLLM's own class, not whichever one is registered.
                and not re.fullmatch(r"[A-Z]\w*", ast.unparse(node.func.value))
            ):
                sites.append(_call_site(path, node))
    return sites


# --- binding ----------------------------------------------------------------------------------------


def bind_failure(signature: inspect.Signature, site: CallSite) -> str | None:
    """Why ``site`` cannot call a function of ``signature`` (``None``: it can).

    A call that spreads ``*args`` / ``**kwargs`` is bound with what it names explicitly
    (``bind_partial``): the spread part is unknown until it runs.
    """
    args = [_PLACEHOLDER] * site.num_positional
    kwargs = dict.fromkeys(site.keywords, _PLACEHOLDER)
    try:
        if site.star_args or site.star_kwargs:
            signature.bind_partial(*args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"{site.where}: {exc} (call passes {site.num_positional} positional, keywords {list(site.keywords)})"
    return None


def assert_sites_bind(signature: inspect.Signature, sites: list[CallSite], what: str) -> int:
    failures = [msg for site in sites if (msg := bind_failure(signature, site)) is not None]
    assert not failures, f"{what}{signature}: vLLM call sites that do not bind:\n" + "\n".join(failures)
    print(f"{what}: bound {len(sites)} vLLM call sites")
    return len(sites)


def superset_failures(ours: inspect.Signature, original: inspect.Signature) -> list[str]:
    """Differences that make ``ours`` not a drop-in for ``original``: a parameter of ``original``
    missing, moved or of another kind, a default of ``original`` changed, or an added parameter
    without a default."""
    problems = []
    mine = list(ours.parameters.values())
    theirs = list(original.parameters.values())
    for i, param in enumerate(theirs):
        if i >= len(mine) or mine[i].name != param.name:
            got = mine[i].name if i < len(mine) else "nothing"
            problems.append(f"parameter {i} is {param.name!r} in vLLM, {got!r} here")
            continue
        if mine[i].kind != param.kind:
            problems.append(f"{param.name!r} is {param.kind.description} in vLLM, {mine[i].kind.description} here")
        if param.default is not inspect.Parameter.empty and mine[i].default != param.default:
            problems.append(f"{param.name!r} defaults to {param.default!r} in vLLM, {mine[i].default!r} here")
    for param in mine[len(theirs) :]:
        if param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            problems.append(f"added parameter {param.name!r} has no default")
    return problems


def calls_accepted_by(ours: inspect.Signature, reference: inspect.Signature) -> list[str]:
    """Calls that ``reference`` accepts and ``ours`` refuses: every parameter passed positionally
    (keyword-only ones by name), and only the required ones."""
    positional = [
        p
        for p in reference.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    keyword_only = [p for p in reference.parameters.values() if p.kind == inspect.Parameter.KEYWORD_ONLY]
    problems = []
    for required_only in (False, True):
        pos = [p for p in positional if not required_only or p.default is inspect.Parameter.empty]
        kws = [p.name for p in keyword_only if not required_only or p.default is inspect.Parameter.empty]
        try:
            ours.bind(*[_PLACEHOLDER] * len(pos), **dict.fromkeys(kws, _PLACEHOLDER))
        except TypeError as exc:
            problems.append(f"({', '.join([p.name for p in pos] + kws)}): {exc}")
    # Every parameter vLLM may pass by name must be accepted by that name.
    for param in positional[: len(positional)]:
        if param.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and param.name not in ours.parameters:
            if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.parameters.values()):
                problems.append(f"keyword {param.name!r} not accepted")
    return problems


def _unwrapped(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


# --- the replaced functions -------------------------------------------------------------------------

V32_ATTENTION = "vllm.models.deepseek_v32.attention"
INDEXER_LAYER = "vllm.model_executor.layers.sparse_attn_indexer"
INDEXER_BUILDER = "vllm.v1.attention.backends.mla.indexer"
DEEP_GEMM = "vllm.utils.deep_gemm"


@pytest.fixture(scope="module")
def installed():
    """The replacements as the plugin installs them: ``{(module, name): installed object}``."""
    import importlib

    for module in (V32_ATTENTION, INDEXER_BUILDER):
        importlib.import_module(module)
    patched = nsa_indexer.install_module_patches()
    routed = mhc.install("auto")
    deep_gemm = importlib.import_module(DEEP_GEMM)
    return {
        (V32_ATTENTION, "sparse_attn_indexer"): patched[V32_ATTENTION],
        (INDEXER_BUILDER, "get_paged_mqa_logits_metadata"): patched[INDEXER_BUILDER],
        (DEEP_GEMM, "tf32_hc_prenorm_gemm"): routed,
        ("original", "tf32_hc_prenorm_gemm"): deep_gemm.tf32_hc_prenorm_gemm.nsa_backend_original,
    }


# (patched module, attribute, our function, where vLLM defines the function it replaces)
REPLACED_FUNCTIONS = [
    pytest.param(V32_ATTENTION, "sparse_attn_indexer", nsa_indexer.nsa_sparse_attn_indexer, INDEXER_LAYER,
                 id="sparse_attn_indexer"),
    pytest.param(INDEXER_BUILDER, "get_paged_mqa_logits_metadata", nsa_indexer._paged_mqa_logits_metadata,
                 DEEP_GEMM, id="get_paged_mqa_logits_metadata"),
    pytest.param(DEEP_GEMM, "tf32_hc_prenorm_gemm", None, DEEP_GEMM, id="tf32_hc_prenorm_gemm"),
]


def _ours_and_original(installed, module: str, name: str, ours: Any, home: str) -> tuple[Any, Any]:
    import importlib

    if ours is None:  # the mHC GEMM: made around vLLM's function at install time
        return installed[(module, name)], installed[("original", name)]
    return ours, getattr(importlib.import_module(home), name)


@pytest.mark.parametrize(("module", "name", "ours", "home"), REPLACED_FUNCTIONS)
def test_installed_attribute_is_our_replacement(installed, module, name, ours, home):
    """The module attribute vLLM's code looks up is (a capture wrapper of) our function."""
    import importlib

    current = getattr(importlib.import_module(module), name)
    assert current is installed[(module, name)]
    if ours is not None:
        assert _unwrapped(current) is ours, f"{module}.{name} is {current!r}, not nsa-backend's"


@pytest.mark.parametrize(("module", "name", "ours", "home"), REPLACED_FUNCTIONS)
def test_every_vllm_call_site_binds(installed, module, name, ours, home):
    """Each call vLLM makes through the replaced attribute binds to our function's signature."""
    fn, _ = _ours_and_original(installed, module, name, ours, home)
    sites = call_sites_of_module_attribute(module, name)
    assert sites, f"no call of {module}.{name} found in vLLM: the replacement reaches nothing"
    assert_sites_bind(inspect.signature(fn), sites, f"{module}.{name}")


@pytest.mark.parametrize(("module", "name", "ours", "home"), REPLACED_FUNCTIONS)
def test_signature_is_superset_of_vllm(installed, module, name, ours, home):
    """Same parameters as vLLM's function in the same order and with the same defaults; added
    parameters have defaults."""
    fn, original = _ours_and_original(installed, module, name, ours, home)
    problems = superset_failures(inspect.signature(fn), inspect.signature(_unwrapped(original)))
    assert not problems, f"{name}: " + "; ".join(problems)


def test_mhc_gemm_callers_look_it_up_at_call_time():
    """``mhc.install`` replaces ``vllm.utils.deep_gemm.tf32_hc_prenorm_gemm``: only callers that
    import it inside the calling function see the replacement."""
    bound_early = module_level_imports(DEEP_GEMM, "tf32_hc_prenorm_gemm")
    assert not bound_early, f"module-level imports bypass the routed mHC GEMM: {bound_early}"


# --- the out-of-tree indexer class ------------------------------------------------------------------


def _indexer_layer_class_source() -> tuple[Path, ast.FunctionDef]:
    import vllm.model_executor.layers.sparse_attn_indexer as layer_module

    path = Path(layer_module.__file__).resolve()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef) and node.name == "SparseAttnIndexer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return path, item
    raise AssertionError(f"{path}: no SparseAttnIndexer.__init__")


def test_indexer_constructor_call_sites_bind():
    """Every ``SparseAttnIndexer(...)`` in vLLM builds :class:`NsaSparseAttnIndexer`, whose
    constructor passes the arguments on to vLLM's: they bind to vLLM's constructor."""
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    ours = inspect.signature(nsa_indexer.NsaSparseAttnIndexer.__init__)
    kinds = {p.kind for p in ours.parameters.values()}
    assert {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
    sites = call_sites_of_module_attribute(INDEXER_LAYER, "SparseAttnIndexer")
    assert sites
    assert_sites_bind(inspect.signature(SparseAttnIndexer), sites, "SparseAttnIndexer(...)")


@pytest.mark.parametrize("name", ["forward_native", "forward_cuda", "forward_hip", "forward_xpu", "forward_cpu",
                                  "forward_oot"])
def test_indexer_forwards_match_vllm(name):
    """Our per-platform forwards take what vLLM's take, and every ``indexer_op(...)`` call binds."""
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    ours = inspect.signature(getattr(nsa_indexer.NsaSparseAttnIndexer, name))
    theirs = inspect.signature(getattr(SparseAttnIndexer, name))
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in list(theirs.parameters.values())[1:]):
        # CustomOp's forward_oot(*args, **kwargs) falls back to forward_native.
        theirs = inspect.signature(SparseAttnIndexer.forward_native)
    assert not calls_accepted_by(ours, theirs), calls_accepted_by(ours, theirs)
    method = inspect.Signature(list(ours.parameters.values())[1:])
    # ``<layer>.indexer_op(...)`` in the modules that build a SparseAttnIndexer (other modules
    # name other ops ``indexer_op``, e.g. GLM-5-Next's SparseAttnIndexerKpool).
    sites = call_sites_of_method("indexer_op", re.compile(r"."), files_importing(INDEXER_LAYER, "SparseAttnIndexer"))
    assert sites
    assert_sites_bind(method, sites, f"indexer_op -> {name}")


def test_indexer_fields_survive_the_deep_gemm_refusal():
    """Without DeepGEMM vLLM's constructor raises after storing the layer's fields, and
    :class:`NsaSparseAttnIndexer` catches that. Every field that vLLM's code or ours reads from the
    layer must be stored before the raise."""
    path, init = _indexer_layer_class_source()
    raise_line = None
    for node in ast.walk(init):
        if isinstance(node, ast.Raise) and "DeepGEMM" in ast.unparse(node):
            raise_line = node.lineno
    assert raise_line is not None, f"{path}: vLLM's constructor no longer refuses without DeepGEMM"
    stored_at = {}
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    stored_at.setdefault(target.attr, node.lineno)
    # Fields vLLM reads from outside (``indexer_op.<field>``) and those our forward reads.
    read_outside = set()
    for path_, text in _sources().items():
        if "indexer_op." in text:
            for node in ast.walk(_tree(path_)):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                    if node.value.attr == "indexer_op":
                        read_outside.add(node.attr)
    ours_reads = set(re.findall(r"self\.(\w+)", inspect.getsource(nsa_indexer.NsaSparseAttnIndexer)))
    needed = sorted((read_outside | ours_reads) & set(stored_at))
    late = [f"{f} (line {stored_at[f]})" for f in needed if stored_at[f] > raise_line]
    assert not late, f"{path}:{raise_line}: fields stored after the DeepGEMM refusal: {late}"
    if "logits_dtype" in stored_at:  # vLLM 0.34+: the fused layer passes the layer's logits_dtype on
        assert "logits_dtype" in needed


# --- registry entries: the backend, its metadata builder and impl ---------------------------------


def _reference_classes(role: str) -> list[type]:
    """vLLM's abstract class for ``role`` and its built-in sparse-MLA classes of that role."""
    from vllm.v1.attention import backend as vb
    from vllm.v1.attention.backends.mla import flashmla_sparse

    refs: dict[str, list[type]] = {
        "backend": [vb.AttentionBackend, flashmla_sparse.FlashMLASparseBackend],
        "builder": [vb.AttentionMetadataBuilder, flashmla_sparse.FlashMLASparseMetadataBuilder],
        "impl": [vb.MLAAttentionImpl, flashmla_sparse.FlashMLASparseImpl],
    }[role]
    try:
        from vllm.v1.attention.backends.mla import flashinfer_mla_sparse_sm120 as fi

        refs += [c for c in vars(fi).values() if isinstance(c, type) and c.__module__ == fi.__name__
                 and issubclass(c, refs[0])]
    except ImportError:
        pass
    return refs


OURS = {
    "backend": [nsa_backend_vllm.NsaSparseMLABackend, nsa_backend_vllm.FlashMLASparseTakeoverBackend,
                nsa_backend_vllm.FlashInferSM120TakeoverBackend],
    "builder": [nsa_backend_vllm.NsaSparseMLAMetadataBuilder],
    "impl": [nsa_backend_vllm.NsaSparseMLAImpl],
}
RECEIVERS = {
    "backend": re.compile(r"(?i)backend"),
    "builder": re.compile(r"(?i)builder"),
    "impl": re.compile(r"(?i)\bimpl\b|_impl\b|\.impl$"),
}


@functools.cache
def _mla_files() -> frozenset[Path]:
    """vLLM modules that call into MLA impls: an ``impl`` there may be ours (elsewhere it is a
    standard attention impl, whose methods take other arguments)."""
    return frozenset(
        path
        for path, text in _sources().items()
        if "MLAAttentionImpl" in text or "MLACommon" in text or "deepseek_v32" in path.parts
    )


def _methods(cls: type) -> dict[str, Any]:
    """Public (and ``_init_*`` hook) methods defined on ``cls`` and its vLLM / nsa-backend bases."""
    found = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] not in ("vllm", "nsa_backend_integrations"):
            continue
        for attr, value in vars(klass).items():
            raw = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            public = not attr.startswith("_") or attr.startswith("_init_")
            if callable(raw) and not isinstance(value, type) and public:
                found[attr] = raw
    return found


def _signature(cls: type, name: str) -> inspect.Signature:
    """Signature of ``cls.name`` as called on an instance or the class (no ``self`` / ``cls``)."""
    raw = inspect.getattr_static(cls, name)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not isinstance(raw, staticmethod) and params:
        params = params[1:]
    return sig.replace(parameters=params)


@pytest.mark.parametrize("role", ["backend", "builder", "impl"])
def test_registered_classes_cover_vllm_methods(role):
    """Every method of vLLM's abstract class and of its built-in sparse-MLA classes that vLLM calls
    exists on ours with a signature that accepts what the reference accepts, and every call vLLM
    makes of it (on a receiver named like the role) binds."""
    failures = []
    total = 0
    files = _mla_files() if role == "impl" else None
    for ours in OURS[role]:
        for ref in _reference_classes(role):
            for name in _methods(ref):
                sites = call_sites_of_method(name, RECEIVERS[role], files)
                if not hasattr(ours, name):
                    if sites:
                        failures.append(f"{ours.__name__} lacks {name} ({ref.__name__} has it; "
                                        f"called at {sites[0].where})")
                    continue
                mine, theirs = _signature(ours, name), _signature(ref, name)
                failures += [f"{ours.__name__}.{name} vs {ref.__name__}: {p}" for p in calls_accepted_by(mine, theirs)]
                # Calls of this method by the same name on the reference's owner only: a name
                # our class inherits unchanged from vLLM binds by construction.
                if inspect.getattr_static(ours, name) is inspect.getattr_static(ref, name):
                    continue
                for site in sites:
                    total += 1
                    if (msg := bind_failure(mine, site)) is not None:
                        failures.append(f"{ours.__name__}.{name}: {msg}")
    print(f"{role}: bound {total} vLLM call sites")
    assert not failures, "\n".join(sorted(set(failures)))


def test_registry_entries_resolve_to_our_classes():
    """``CUSTOM`` (and the takeover names, when registered) resolve to the classes checked above."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is nsa_backend_vllm.NsaSparseMLABackend
    backend = nsa_backend_vllm.NsaSparseMLABackend
    assert backend.get_impl_cls() in OURS["impl"] and backend.get_builder_cls() in OURS["builder"]
