"""No function in pdrouter/, workers/ or kernels/ is longer than MAX_LINES.

A function's length runs from its `def` line to its last line, nested functions included (they
count again on their own). Past MAX_LINES a function does several things: split it into named
steps. The exceptions are declarative tables, one entry a line or two, which read best whole;
each is listed by name with what it is, and an entry that no longer needs its place (gone, or
back under the bound) fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.repo import REPO_ROOT

ROOTS = ("pdrouter", "workers", "kernels")
MAX_LINES = 80

# "path::qualified name" -> what the table is.
TABLES: dict[str, str] = {
    "pdrouter/router/observability/metrics.py::RouterMetrics.__init__": (
        "the router's metrics table: one metric, its labels and help a few lines each"
    ),
    "pdrouter/router/instances/admin_api.py::install_instances_routes": (
        "the /instances route table: each route a short handler over the registry"
    ),
}


def function_lengths() -> Iterator[tuple[str, int]]:
    """("path::Class.function", lines) for every function and method under ROOTS."""
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = path.relative_to(REPO_ROOT).as_posix()
            yield from _walk(ast.parse(path.read_text(), str(path)), f"{name}::")


def _walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            qualname = prefix + child.name
            assert child.end_lineno is not None
            yield qualname, child.end_lineno - child.lineno + 1
            yield from _walk(child, qualname + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, prefix + child.name + ".")
        else:
            yield from _walk(child, prefix)


def test_no_function_is_longer_than_the_bound():
    too_long = [
        f"{name}: {lines} lines"
        for name, lines in function_lengths()
        if lines > MAX_LINES and name not in TABLES
    ]
    assert not too_long, f"functions over {MAX_LINES} lines (split them):\n" + "\n".join(too_long)


def test_every_table_listed_still_needs_its_place():
    lengths = dict(function_lengths())
    stale = [
        f"{name}: {'gone' if name not in lengths else f'{lengths[name]} lines'}"
        for name in TABLES
        if lengths.get(name, 0) <= MAX_LINES
    ]
    assert not stale, "remove from TABLES:\n" + "\n".join(stale)


def test_lengths_are_counted_per_function_and_class():
    source = "class A:\n    def f(self):\n        def g():\n            pass\n        return 1\n"
    assert dict(_walk(ast.parse(source), "m.py::")) == {"m.py::A.f": 4, "m.py::A.f.g": 2}
