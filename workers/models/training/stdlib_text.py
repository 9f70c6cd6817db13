"""English text from the running Python's standard library (Python Software Foundation License).

Four sources, every one shipped with CPython, read without importing pure-Python modules (no
import side effects, and the order is the sorted file order, so the output is a pure function
of the Python installation):

    source docstrings   ast over Lib/**/*.py: module, class and function docstrings
    C docstrings        builtins and the C extension modules (imported: they have no Python
                        source), e.g. `len`, `math.sqrt`
    pydoc topics        pydoc_data.topics: the language reference sections `help()` shows
    comments            prose comment blocks of Lib/**/*.py

Private modules and names (a leading underscore), tests, idlelib, lib2to3 and turtledemo are
left out.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIPPED_PACKAGES = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip"}
)
# Modules whose import has side effects or that hold no prose.
SKIPPED_MODULES = frozenset({"antigravity", "this", "__hello__", "__phello__"})
_ROLE = re.compile(r":(?:[a-zA-Z]+:)*[a-zA-Z]+:`~?([^`<]+?)(?:\s*<[^>]*>)?`")


@dataclass(frozen=True)
class DocEntry:
    """One piece of documentation. `module` decides the split: a module's entries stay together."""

    module: str  # "json", "builtins", "topic:if"
    name: str  # "json", "json.dumps", 'The "if" statement'
    kind: str  # "module" | "class" | "function" | "topic" | "comments"
    text: str
    signature: str = ""  # "(obj, *, skipkeys=False, ...)" for functions, when known


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def clean_rest(text: str) -> str:
    """reST markup a reader does not need: `:func:\\`json.dumps\\`` -> json.dumps, ``x`` -> `x`."""
    text = _ROLE.sub(r"\1", text)
    return text.replace("``", "`")


def public_module_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) of every public pure-Python module, in sorted order."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or parts[-1] == "__main__":
            continue
        if any(p in SKIPPED_PACKAGES or p.startswith("_") for p in parts):
            continue
        name = ".".join(parts)
        if name not in SKIPPED_MODULES:
            yield name, path


def source_entries(root: Path) -> Iterator[DocEntry]:
    """Docstrings of every public module, class and function, by ast (nothing is imported)."""
    for module, path in public_module_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree)
        if doc:
            yield DocEntry(module, module, "module", clean_rest(doc))
        yield from _definitions(module, module, tree.body)


def _definitions(module: str, prefix: str, body: list[ast.stmt]) -> Iterator[DocEntry]:
    for node in body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if node.name.startswith("_"):
            continue
        name = f"{prefix}.{node.name}"
        doc = ast.get_docstring(node)
        if isinstance(node, ast.ClassDef):
            if doc:
                yield DocEntry(module, name, "class", clean_rest(doc))
            yield from _definitions(module, name, node.body)
        elif doc:
            signature = f"({ast.unparse(node.args)})"
            yield DocEntry(module, name, "function", clean_rest(doc), signature)


def extension_modules() -> list[str]:
    """Public C modules: compiled into the interpreter or shipped in lib-dynload."""
    names = set(sys.builtin_module_names)
    dynload = stdlib_root() / "lib-dynload"  # platstdlib would name a venv's own folder
    names.update(p.name.split(".")[0] for p in dynload.glob("*.so"))
    return sorted(n for n in names if not n.startswith("_") and not n.startswith("xx"))


def extension_entries() -> Iterator[DocEntry]:
    """Docstrings of the C modules, their public functions, classes and methods."""
    for module in extension_modules():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if mod.__doc__:
            yield DocEntry(module, module, "module", clean_rest(inspect.cleandoc(mod.__doc__)))
        # Builtins are known by their bare names: `len`, not `builtins.len`.
        prefix = "" if module == "builtins" else module + "."
        for attr in sorted(vars(mod)):
            value = getattr(mod, attr)
            if attr.startswith("_") or getattr(value, "__module__", module) != module:
                continue
            if inspect.isclass(value):
                yield from _class_entries(module, prefix + attr, value)
            elif callable(value) and value.__doc__:
                yield _callable_entry(module, prefix + attr, value, "function")


def _class_entries(module: str, name: str, cls: type) -> Iterator[DocEntry]:
    if cls.__doc__:
        yield DocEntry(module, name, "class", clean_rest(inspect.cleandoc(cls.__doc__)))
    for attr in sorted(vars(cls)):
        value = vars(cls)[attr]
        if attr.startswith("_") or not callable(value) or not getattr(value, "__doc__", None):
            continue
        yield _callable_entry(module, f"{name}.{attr}", value, "function")


def _callable_entry(module: str, name: str, value: object, kind: str) -> DocEntry:
    try:
        signature = str(inspect.signature(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        signature = ""
    doc = inspect.cleandoc(value.__doc__ or "")
    return DocEntry(module, name, kind, clean_rest(doc), signature)


def topic_entries() -> Iterator[DocEntry]:
    """The language reference sections of pydoc_data.topics, keyed by topic."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key].strip("\n")
        title = text.split("\n", 1)[0].strip()
        yield DocEntry(f"topic:{key}", title, "topic", text)


def comment_entries(root: Path, min_chars: int = 80) -> Iterator[DocEntry]:
    """Prose comment blocks of each public module: consecutive comment lines joined, kept
    when long enough and mostly letters (commented-out code and banners are dropped)."""
    for module, path in public_module_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
            continue
        blocks: list[list[str]] = []
        last_line = -2
        for tok in tokens:
            if tok.type != tokenize.COMMENT:
                continue
            line = tok.string.lstrip("#").strip()
            if tok.start[0] == last_line + 1 and blocks:
                blocks[-1].append(line)
            else:
                blocks.append([line])
            last_line = tok.start[0]
        prose = [" ".join(w for w in b if w) for b in blocks]
        prose = [p for p in prose if _is_prose(p, min_chars)]
        if prose:
            yield DocEntry(module, module, "comments", "\n\n".join(prose))


def _is_prose(text: str, min_chars: int) -> bool:
    if len(text) < min_chars or "copyright" in text.lower() or "license" in text.lower():
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters >= 0.85 * len(text) and len(text.split()) >= 12
