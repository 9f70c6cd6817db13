"""benchmarks/ holds only what a `make bench*` target runs, and no benchmark imports tests/.

A module is reached when a bench target runs it (`python -m` and its dotted name in the recipe) or
when a reached module imports it or starts it as a process (the module's dotted name as a
string constant, as in `[sys.executable, "-m", "benchmarks.router.mock_backend"]`); running a
module imports its parent packages too. Any other file under benchmarks/ must be named in the
Makefile (a shell helper a target's comment tells to source). A one-off probe left in the tree
fails here: once its finding is written in docs/benchmarks/ (with its command and the commit
where it lived), the probe goes.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

from tests.repo import REPO_ROOT
from tests.test_import_graph import _imported_names

_TARGET = re.compile(r"^(bench[\w-]*):")
_RUN_MODULE = re.compile(r"-m (benchmarks(?:\.\w+)*)")


def _modules(root: Path) -> dict[str, Path]:
    """Every module under root/benchmarks by dotted name (a package by its __init__)."""
    found = {}
    for path in sorted((root / "benchmarks").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _entries(makefile: Path) -> dict[str, set[str]]:
    """The modules each bench target's recipe runs with `-m`."""
    entries: dict[str, set[str]] = {}
    target = None
    for line in makefile.read_text().splitlines():
        if match := _TARGET.match(line):
            target = match.group(1)
            entries.setdefault(target, set())
        elif not line.startswith("\t"):
            target = None
        elif target is not None:
            entries[target].update(_RUN_MODULE.findall(line))
    return entries


def _edges(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Modules of benchmarks that name imports or starts as a process."""
    tree = ast.parse(path.read_text(), str(path))
    named = set(_imported_names(path, name))
    named |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in modules}
    edges = set()
    for imported in named:
        while imported and imported not in modules:  # a name inside a module: the module
            imported = imported.rpartition(".")[0]
        if imported:
            edges.add(imported)
    return edges


def _with_parents(name: str, modules: dict[str, Path]) -> set[str]:
    """name, its `__main__` when it is a package run with -m, and every package above it."""
    parts = name.split(".")
    found = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} | {f"{name}.__main__"}
    return found & modules.keys()


def unreached(root: Path) -> list[str]:
    """Files under root/benchmarks that no bench target of root/Makefile reaches."""
    modules = _modules(root)
    makefile = root / "Makefile"
    todo = [run for runs in _entries(makefile).values() for run in runs]
    reached: set[str] = set()
    while todo:
        for name in _with_parents(todo.pop(), modules) - reached:
            reached.add(name)
            todo.extend(_edges(modules[name], name, modules))
    stray = [str(modules[name].relative_to(root)) for name in sorted(modules.keys() - reached)]
    others = [
        str(path.relative_to(root))
        for path in sorted((root / "benchmarks").rglob("*"))
        if path.is_file() and path.suffix != ".py" and "__pycache__" not in path.parts
    ]
    return stray + [other for other in others if other not in makefile.read_text()]


def imports_of_tests(root: Path) -> list[str]:
    """`module: imported name` for every import of tests/ by a benchmarks module."""
    found = []
    for name, path in _modules(root).items():
        for imported in _imported_names(path, name):
            if imported.split(".")[0] == "tests":
                found.append(f"{name}: {imported}")
    return sorted(set(found))


def test_every_benchmark_module_is_reached_from_a_bench_target() -> None:
    assert _entries(REPO_ROOT / "Makefile")["bench-handoff"] == {
        "benchmarks.handoff",
        "benchmarks.handoff.chunked",
        "benchmarks.handoff.integrity",
        "benchmarks.handoff.tp",
    }
    assert unreached(REPO_ROOT) == []


def test_no_benchmark_imports_the_tests() -> None:
    assert imports_of_tests(REPO_ROOT) == []


def _copy_of_the_tree(tmp_path: Path) -> Path:
    shutil.copytree(REPO_ROOT / "benchmarks", tmp_path / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(REPO_ROOT / "Makefile", tmp_path / "Makefile")
    return tmp_path


def test_a_stray_probe_and_a_stray_script_are_found(tmp_path: Path) -> None:
    root = _copy_of_the_tree(tmp_path)
    assert unreached(root) == []
    probe = root / "benchmarks" / "handoff" / "stray_probe.py"
    probe.write_text("from benchmarks.handoff.kv import KvShape\n")
    (root / "benchmarks" / "notes.sh").write_text("echo\n")
    assert unreached(root) == ["benchmarks/handoff/stray_probe.py", "benchmarks/notes.sh"]
    # Reached once a reached module imports it (an import inside a function counts).
    table = root / "benchmarks" / "handoff" / "table.py"
    table.write_text(table.read_text() + "\ndef _f():\n    from . import stray_probe\n")
    assert unreached(root) == ["benchmarks/notes.sh"]


def test_a_module_only_started_as_a_process_is_reached(tmp_path: Path) -> None:
    root = _copy_of_the_tree(tmp_path)
    bench = root / "benchmarks" / "router" / "bench_router.py"
    bench.write_text(bench.read_text().replace('"benchmarks.router.bare_relay"', '"elsewhere"'))
    assert unreached(root) == ["benchmarks/router/bare_relay.py"]


def test_an_import_of_the_tests_is_found(tmp_path: Path) -> None:
    root = _copy_of_the_tree(tmp_path)
    engine = root / "benchmarks" / "engine.py"
    engine.write_text(engine.read_text() + "\ndef _f():\n    from tests.wait import wait_until\n")
    assert imports_of_tests(root) == [
        "benchmarks.engine: tests.wait",
        "benchmarks.engine: tests.wait.wait_until",
    ]
