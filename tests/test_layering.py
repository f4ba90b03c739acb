"""Imports inside ``nsa_backend`` point one way: public ops -> ``_dispatch`` -> ``routing`` -> ``kernels`` / ``native``.

Every module under ``nsa_backend/`` is parsed (no import is executed) and every ``import`` statement is read,
the ones inside functions included, so an import moved into a function body to get around a cycle still
counts. The checks:

- a module of ``nsa_backend.kernels`` or ``nsa_backend.native`` imports neither ``nsa_backend.routing``,
  ``nsa_backend._dispatch``, a public op module nor the ``nsa_backend`` package itself (which imports them);
- a module of ``nsa_backend.routing`` imports neither ``nsa_backend._dispatch``, a public op module nor the
  ``nsa_backend`` package;
- no import cycle exists among ``nsa_backend`` modules. An edge goes to the module an import statement names
  (``from a.b import c`` -> ``a.b.c`` when that is a module, else ``a.b``); the implicit import of parent
  packages is not an edge (a family's variant importing the family's shared module runs the family's
  ``__init__`` first, which is no cycle). Third-party imports are not edges.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nsa_backend"
PACKAGE = "nsa_backend"
# Public op modules: the layer above ``_dispatch``.
PUBLIC_OPS = frozenset(f"{PACKAGE}.{name}" for name in
                       ("indexer", "topk", "sparse_mla", "mhc", "quant", "quant_v4", "metadata", "dsa"))
# What each lower layer must not import (a name matches itself and its submodules).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    f"{PACKAGE}.kernels": (f"{PACKAGE}.routing", f"{PACKAGE}._dispatch", *sorted(PUBLIC_OPS)),
    f"{PACKAGE}.native": (f"{PACKAGE}.routing", f"{PACKAGE}._dispatch", *sorted(PUBLIC_OPS)),
    f"{PACKAGE}.routing": (f"{PACKAGE}._dispatch", *sorted(PUBLIC_OPS)),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported nsa_backend module, line)`` for every import statement of ``path``, at any depth."""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names if _within(alias.name, PACKAGE)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative import: resolve against this module's package.
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _within(source, PACKAGE):
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"
                out.append((child if child in known else source, node.lineno))
    return out


def _graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path, known):
            # ``import nsa_backend.a.b`` where only ``nsa_backend.a`` exists stays an edge to ``nsa_backend.a``.
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph, modules


def _cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Strongly connected components of more than one module (Tarjan): ``(sorted members, one cycle)``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [(sorted(component), _one_cycle(graph, set(component))) for component in components]


def _one_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module (by name) of ``component``, closed (first == last)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ not in component:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if succ not in parents:
                    parents[succ] = node
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def layering_violations() -> list[str]:
    """Every broken rule, one line each (empty when the layering holds)."""
    graph, modules = _graph()
    problems = []
    for name, edges in sorted(graph.items()):
        for layer, banned in FORBIDDEN.items():
            if not _within(name, layer):
                continue
            for target, line in sorted(edges.items()):
                hit = target == PACKAGE or any(_within(target, prefix) for prefix in banned)
                if hit:
                    where = modules[name].relative_to(ROOT.parent)
                    problems.append(f"{where}:{line}: {layer} module {name} imports {target} (a higher layer)")
    for members, cycle in _cycles(graph):
        steps = " -> ".join(
            f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"
        problems.append(f"import cycle: {steps}; modules on cycles together: {', '.join(members)}")
    return problems


def test_module_graph_is_found():
    # The checks below are empty-handed if the walk finds nothing; make sure it sees the real tree.
    graph, _ = _graph()
    assert f"{PACKAGE}._dispatch" in graph and f"{PACKAGE}.routing.router" in graph
    assert f"{PACKAGE}.routing.router" in graph[f"{PACKAGE}._dispatch"]
    assert any(name.startswith(f"{PACKAGE}.kernels.") for name in graph)


def test_layers_point_one_way_and_no_cycles():
    problems = layering_violations()
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_checker_catches_function_level_cycle(tmp_path, monkeypatch):
    # A function-level import that closes a cycle, and a kernel importing routing, are both reported.
    pkg = tmp_path / PACKAGE
    for sub in ("kernels", "routing"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "a.py").write_text("from nsa_backend.kernels import b\n")
    (pkg / "kernels" / "b.py").write_text("def f():\n    from nsa_backend.kernels.a import x\n"
                                          "    from nsa_backend.routing import router\n")
    (pkg / "routing" / "router.py").write_text("")
    monkeypatch.setitem(globals(), "ROOT", pkg)
    problems = layering_violations()
    assert any("kernels module nsa_backend.kernels.b imports nsa_backend.routing.router" in p for p in problems)
    assert any(p.startswith("import cycle: nsa_backend.kernels.a") for p in problems), problems
