"""The tree's shape, checked on every run: no import cycles, the router never imports the
workers, no module over 400 lines.

Every import counts, wherever it is written: at the top, inside a function, under
TYPE_CHECKING. A package's `__init__` re-exports are not edges (importing `kernels` for its
public names does not make every module of it depend on the others).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.repo import REPO_ROOT

ROOTS = ("pdrouter", "workers", "kernels", "benchmarks")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for root in ROOTS
        for path in sorted((REPO_ROOT / root).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _imported_names(path: Path, module: str) -> Iterator[str]:
    """Every dotted name an import statement in the file can bind, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """Modules of ROOTS and, for each, the modules of ROOTS it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported in _imported_names(path, name):
            while imported and imported not in modules:  # a name inside a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return modules, graph


def _cycles(modules: dict[str, Path], graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    is_package = {name for name, path in modules.items() if path.name == "__init__.py"}
    edges = {n: sorted(d for d in deps if d not in is_package) for n, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index or start in is_package:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def problems() -> list[str]:
    modules, graph = import_graph()
    found = [" <-> ".join(cycle) for cycle in _cycles(modules, graph)]
    found = [f"import cycle: {cycle}" for cycle in found]
    for name, deps in sorted(graph.items()):
        if name.split(".")[0] == "pdrouter":
            into_workers = sorted(d for d in deps if d.split(".")[0] == "workers")
            if into_workers:
                found.append(f"{name} imports workers: {', '.join(into_workers)}")
    for path in sorted(modules.values()):
        num_lines = path.read_text().count("\n")
        if num_lines > MAX_LINES:
            found.append(f"{path.relative_to(REPO_ROOT)}: {num_lines} lines (> {MAX_LINES})")
    return found


def test_no_cycles_no_router_to_worker_imports_no_long_modules() -> None:
    found = problems()
    assert found == [], "\n".join(found)


def test_the_checker_sees_imports_inside_functions_and_type_checking(tmp_path: Path) -> None:
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pdrouter.wire import pd\n"
        "def f():\n"
        "    from . import sibling\n"
        "    import workers.engine.api\n"
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    names = set(_imported_names(path, "pdrouter.router.mod"))
    assert {"pdrouter.wire.pd", "pdrouter.router.sibling", "workers.engine.api"} <= names


def test_the_checker_finds_a_cycle_and_ignores_package_reexports() -> None:
    modules = {name: Path(f"/{name.replace('.', '/')}.py") for name in ("a.x", "a.y", "a.z")}
    modules["a"] = Path("/a/__init__.py")
    graph = {"a.x": {"a.y"}, "a.y": {"a.x", "a"}, "a.z": {"a"}, "a": {"a.x", "a.z"}}
    assert _cycles(modules, graph) == [["a.x", "a.y"]]
