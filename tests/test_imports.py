"""Import structure: no import cycles in edgespec, counting imports inside functions too.

A lazy import inside a function hides a cycle from Python but not from a reader: the two modules
still depend on each other (backends.py's factory imported both backends, which import backends.py).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "edgespec"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> edgespec modules it imports anywhere in its body (package __init__s excluded as
    targets: importing edgespec.x.y runs edgespec/x/__init__.py, which is not a dependency cycle)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                if target in modules and target != name and not modules[target].name == "__init__.py":
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    # factory.py imports both backends inside create_backend(): the graph must count that.
    assert {"edgespec.verifier.llama_backend", "edgespec.verifier.torch.backend"} <= graph["edgespec.verifier.factory"]
    assert "edgespec.verifier.backends" in graph["edgespec.verifier.llama_backend"]


def test_no_import_cycles():
    assert not cycles(import_graph()), "modules that import each other (directly or through others)"


def test_backends_module_imports_no_backend():
    assert not {m for m in import_graph()["edgespec.verifier.backends"] if "backend" in m.rpartition(".")[2]}
