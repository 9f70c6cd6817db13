"""Prose that cannot go stale: every name the prose gives for a part of this repository exists.

Read: the comments and string literals (docstrings, help texts, messages) of the .py files
under pdrouter/, workers/ and kernels/, every other text file there (the .cu sources), the
comments and docstrings of tests/, benchmarks/ and examples/ (their other strings are test
data), and README.md and docs/**/*.md. What counts as a reference, and how it is checked, without
importing any of the code (no Paddle):

- a dotted name that starts with a package of the repo (`workers.pool.client.KVPoolClient`):
  the longest prefix that is a module must exist, and the rest must be defined in it (a
  top-level def, class, assignment or import; then a class's def, field or `self.` attribute);
- a path under a top folder of the repo (`workers/pool/keys.py`, `docs/benchmarks/`): it
  exists (globs and `{a,b}` patterns are checked by their fixed prefix);
- a shorter path (`pool/keys.py`) or a bare file name (`keys.py`): some file of the repo ends
  with it;
- `python -m X` with X a module of the repo: X is a module (or a package with __main__.py);
- `make X` where it is a command (in backticks, or starting a line of a code block or of a
  comment): X is a target of the Makefile.
- `--flag` in README.md and docs/**/*.md: a flag of some command of the repo, or of an
  outside tool the docs run, each named with its reason (tests/doc_flags.py).

The design prose stays short (STYLE 19): docs/architecture.md, the overview, at most 300
lines and linking every docs/design/ page; each of those at most 400 lines.

History is told as behaviour, never by a tracker's number (the word issue or PR and then a
number): the number means nothing to a reader of the code (test_no_history_by_tracker_number).

Not references, so not checked: text on a line that names a commit (`at commit 1a2b3c4`,
history: the command that measured a recorded finding may be gone since), and the NOT_REFS
below, each with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests import doc_flags
from tests.repo import REPO_ROOT

PACKAGES = ("pdrouter", "workers", "kernels", "benchmarks", "tests", "examples")
TOP_DIRS = (*PACKAGES, "docs")
CODE_ROOTS = ("pdrouter", "workers", "kernels")
FILE_SUFFIXES = "py|md|cu|cuh|h|cpp|toml|json|sh|txt|png|safetensors|yaml|yml|cfg|ini"

# Strings that look like references and are not, with the reason (a key ending in "/" covers
# every path under it).
NOT_REFS: dict[str, str] = {
    "pdrouter/kv/v1": "the pool keys' root hash tag (workers.pool.keys.ROOT_TAG), a byte string",
    "pdrouter/checkpoint/v1": "the checkpoint digest's hash tag, a byte string",
    "mooncake/": "a file inside the installed Mooncake wheel (site-packages/mooncake/)",
    "mooncake-store/": "Mooncake's source tree (github.com/kvcache-ai/Mooncake)",
}

_DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
_PATH = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(TOP_DIRS)})/[\w./{{}},*-]*)")
_SHORT_PATH = re.compile(rf"(?<![\w./~$-])([\w-]+(?:/[\w-]+)*/[\w.-]+\.(?:{FILE_SUFFIXES}))\b")
_FILE_NAME = re.compile(r"(?<![\w./~$-])([A-Za-z_][\w-]*\.(?:py|cu|cuh|md))\b")
_PYTHON_M = re.compile(r"python3?\s+-m[\s#]+([A-Za-z_][\w.]*)")
# `make X` as a command: in backticks, after a prompt or &&, or alone on its line (with
# variables or a comment after it); "make sure ..." in a sentence is not one.
_MAKE = re.compile(
    r"(?:`|\$ |&& |^[ \t#]*)make +([a-z][\w-]*)(?=`|[ \t]*(?:$|#|&&|[A-Z_]+=))", re.MULTILINE
)
_ARGUMENT = re.compile(r"--[\w-]+[ =]$")  # a file name after a flag is an output, not a ref
_TRACKER = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+", re.IGNORECASE)
_COMMIT = re.compile(r"\bcommit [0-9a-f]{7,40}\b")


@dataclass(frozen=True)
class Text:
    """A piece of prose and where it starts."""

    path: Path
    line: int
    text: str


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}: {self.ref!r}: {self.why}"


@cache
def repo_files() -> tuple[str, ...]:
    """The repository's files (tracked, or new and not ignored), as posix paths; outside a git
    checkout, every file but hidden folders' and caches'."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        out = [
            p.relative_to(REPO_ROOT).as_posix()
            for p in REPO_ROOT.rglob("*")
            if p.is_file()
            and not any(
                part.startswith(".") or part == "__pycache__"
                for part in p.relative_to(REPO_ROOT).parts
            )
        ]
    return tuple(p for p in out if (REPO_ROOT / p).is_file())


@cache
def repo_dirs() -> frozenset[str]:
    dirs = set()
    for path in repo_files():
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return frozenset(dirs)


# ---- what is read ---------------------------------------------------------------------------


def _python_prose(path: Path, strings: bool) -> Iterator[Text]:
    """Comments and docstrings of a .py file, and its other string literals if strings."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (strings and tok.type == tokenize.STRING):
            yield Text(path, tok.start[0], tok.string)
    if strings:
        return
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield Text(path, first.lineno, first.value.value)


def _is_text(name: str, top: str, suffix: str) -> bool:
    """A whole file that is prose: the code's other text files, the README and the docs."""
    if top in CODE_ROOTS:
        return suffix in (".cu", ".cuh", ".h", ".md")
    return name == "README.md" or (top == "docs" and suffix == ".md")


def prose() -> Iterator[Text]:
    """The code's comments and strings (help texts, messages: prose a user reads too), the
    comments and docstrings of the tests, benchmarks and examples (their other strings are
    test data), the other text files of the code, and the docs."""
    for name in repo_files():
        path = REPO_ROOT / name
        top = name.split("/", 1)[0]
        if top in PACKAGES and path.suffix == ".py":
            yield from _python_prose(path, strings=top in CODE_ROOTS)
        elif _is_text(name, top, path.suffix):
            yield Text(path, 1, path.read_text())


def _without_history(text: str) -> str:
    """text with each line that names a commit blanked (same length, same line numbers)."""
    return "\n".join(" " * len(line) if _COMMIT.search(line) else line for line in text.split("\n"))


# ---- how a reference is checked -------------------------------------------------------------


def _module_path(parts: list[str]) -> Path | None:
    base = REPO_ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds (through if/try blocks too)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(elt, ast.Name):
                        names[elt.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            nested = node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            names.update(_defined(nested))
    return names


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    names = set(_defined(cls.body))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


@cache
def _module_names(path: Path) -> dict[str, ast.AST]:
    return _defined(ast.parse(path.read_text(), str(path)).body)


def check_dotted(name: str) -> str | None:
    """None when name resolves, else why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_path(parts[:cut])
        if module is not None:
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest:
        return None
    node = _module_names(module).get(rest[0])
    if node is None:
        if (REPO_ROOT.joinpath(*parts[:cut]) / rest[0]).is_dir():
            return None  # a folder without __init__.py (data, not code)
        return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        imported = next(a.name for a in node.names if (a.asname or a.name) == rest[0])
        if node.module.split(".")[0] in PACKAGES:
            return check_dotted(".".join([node.module, imported, *rest[1:]]))
        return None
    if isinstance(node, ast.ClassDef) and len(rest) > 1 and rest[1] not in _class_attributes(node):
        return f"class {rest[0]} has no {rest[1]}"
    return None


def _fixed_prefix(path: str) -> str:
    """The part of a path before any glob or brace pattern, without a trailing dot."""
    cut = min((i for i, ch in enumerate(path) if ch in "*{},"), default=len(path))
    return path[:cut].rstrip(".")


def check_path(path: str) -> str | None:
    fixed = _fixed_prefix(path)
    if fixed != path:  # a pattern: its fixed part must be a folder, or a prefix of a file
        folder = fixed.rstrip("/")
        if folder in repo_dirs() or any(f.startswith(fixed) for f in repo_files()):
            return None
        return "no file matches"
    path = path.rstrip(".,")
    if path.rstrip("/") in repo_dirs() or path in repo_files():
        return None
    module, dot, attr = path.rpartition("/")[2].partition(".")
    stem = path.rpartition("/")[0] + "/" + module
    if dot and stem + ".py" in repo_files():  # workers/handoff/tasks.wait_to_end
        return check_dotted(stem.replace("/", ".") + "." + attr)
    return "no such file or folder"


def check_short_path(path: str) -> str | None:
    if any(f == path or f.endswith("/" + path) for f in repo_files()):
        return None
    return "no file of the repo ends with it"


def check_python_m(module: str) -> str | None:
    if module.split(".")[0] not in PACKAGES:
        return None  # pytest, pip, another project's module
    parts = module.split(".")
    if REPO_ROOT.joinpath(*parts).with_suffix(".py").is_file():
        return None
    if (REPO_ROOT.joinpath(*parts) / "__main__.py").is_file():
        return None
    return "not a runnable module of the repo"


@cache
def make_targets() -> frozenset[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, re.MULTILINE))


def check_make(target: str) -> str | None:
    return None if target in make_targets() else "no such Makefile target"


# ---- the walk -------------------------------------------------------------------------------


def _not_a_ref(ref: str) -> bool:
    return ref in NOT_REFS or any(ref.startswith(k) for k in NOT_REFS if k.endswith("/"))


CHECKS = (  # longest kind first: a span one kind matched is not checked by a later one
    (_PYTHON_M, check_python_m),
    (_DOTTED, check_dotted),
    (_PATH, check_path),
    (_SHORT_PATH, check_short_path),
    (_FILE_NAME, check_short_path),
    (_MAKE, check_make),
)


def findings_in(text: Text) -> Iterator[Finding]:
    body = _without_history(text.text)
    spans: list[tuple[int, int]] = []
    for pattern, check in CHECKS:
        for match in pattern.finditer(body):
            if any(a <= match.start(1) < b for a, b in spans):
                continue
            spans.append(match.span(1))
            ref = match.group(1)
            if check is check_short_path and _ARGUMENT.search(body, 0, match.start(1)):
                continue
            why = None if _not_a_ref(ref) else check(ref)
            if why:
                line = text.line + body.count("\n", 0, match.start(1))
                shown = "make " + ref if check is check_make else ref
                yield Finding(text.path, line, shown, why)


def all_findings() -> list[Finding]:
    return [finding for text in prose() for finding in findings_in(text)]


def test_every_name_the_prose_gives_exists():
    findings = all_findings()
    assert not findings, "stale references:\n" + "\n".join(map(str, findings))


def test_no_history_by_tracker_number():
    found = [
        f"{text.path.relative_to(REPO_ROOT)}:{text.line + text.text.count(chr(10), 0, m.start())}"
        f": {m.group(0)!r}"
        for text in prose()
        for m in _TRACKER.finditer(text.text)
    ]
    assert not found, "say what the code does instead:\n" + "\n".join(found)


def test_the_checks_catch_what_they_should():
    def found(line: str) -> list[str]:
        return [f.ref for f in findings_in(Text(REPO_ROOT / "README.md", 1, line))]

    assert found("see workers.pool.client.KVPoolClient.get_into") == []
    assert found("see workers.pool.client.KVPoolClient.no_such") == [
        "workers.pool.client.KVPoolClient.no_such"
    ]
    assert found("see workers.pool.no_such_module.") == ["workers.pool.no_such_module"]
    assert found("in workers/pool/keys.py and docs/benchmarks/*.md") == []
    assert found("in workers/pool/gone.py") == ["workers/pool/gone.py"]
    assert found("in pool/keys.py, keys.py") == []
    assert found("in pool/gone.py, gone.py") == ["pool/gone.py", "gone.py"]
    assert found("run `python -m workers.cli` or `make test`") == []
    assert found("run `python -m workers.gone` or `make gone`") == ["workers.gone", "make gone"]
    assert found("measured at commit 1a2b3c4: python -m benchmarks.gone") == []
    assert found("make sure the pool is up") == []
    assert [m.group(0) for m in _TRACKER.finditer("as issue 13 §1 and PR #4 found")] == [
        "issue 13",
        "PR #4",
    ]
    assert _TRACKER.search("an issue with 3 keys") is None


# ---- flags and page lengths of the docs ------------------------------------------------------

OVERVIEW = REPO_ROOT / "docs" / "architecture.md"
DESIGN_DIR = REPO_ROOT / "docs" / "design"
MAX_OVERVIEW_LINES = 300  # read in ten minutes
MAX_DESIGN_PAGE_LINES = 400  # one subsystem a page


def docs_prose() -> Iterator[Text]:
    """README.md and docs/**/*.md, whole."""
    for text in prose():
        name = text.path.relative_to(REPO_ROOT).as_posix()
        if name == "README.md" or (name.startswith("docs/") and name.endswith(".md")):
            yield text


def flag_findings_in(text: Text) -> Iterator[Finding]:
    """Each --flag the text names that no command has (lines naming a commit are history)."""
    body = _without_history(text.text)
    for match in doc_flags.FLAG.finditer(body):
        why = doc_flags.check_flag(match.group(1), repo_files())
        if why:
            line = text.line + body.count("\n", 0, match.start(1))
            yield Finding(text.path, line, match.group(1), why)


def test_every_flag_the_docs_name_exists():
    findings = [f for text in docs_prose() for f in flag_findings_in(text)]
    assert not findings, "flags no command has:\n" + "\n".join(map(str, findings))


def test_every_outside_flag_allowed_is_named_by_the_docs():
    named = {m.group(1) for text in docs_prose() for m in doc_flags.FLAG.finditer(text.text)}
    assert sorted(doc_flags.EXTERNAL_FLAGS - named) == []


def test_the_flag_check_catches_a_made_up_flag(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text(
        "Run `pdworker serve --pool-wait-s 5 --engine-backend torch`, then\n"
        "`python -m benchmarks.handoff.tp --reader-tp 2` and `pytest --dist loadfile`;\n"
        "`pdrouter serve --no-such-flag` and D's allocation `--wait-s` do not exist.\n"
        "Ranges such as 1--2 and a rule |---| are not flags.\n"
    )
    found = list(flag_findings_in(Text(doc, 1, doc.read_text())))
    assert [(f.line, f.ref) for f in found] == [(3, "--no-such-flag"), (3, "--wait-s")]


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def test_the_overview_and_each_design_page_are_short():
    long = (
        [f"{OVERVIEW.name}: {_lines(OVERVIEW)} lines"]
        if _lines(OVERVIEW) > MAX_OVERVIEW_LINES
        else []
    )
    long += [
        f"design/{page.name}: {_lines(page)} lines"
        for page in sorted(DESIGN_DIR.glob("*.md"))
        if _lines(page) > MAX_DESIGN_PAGE_LINES
    ]
    assert not long, (
        f"overview at most {MAX_OVERVIEW_LINES} lines, a design page at most "
        f"{MAX_DESIGN_PAGE_LINES}: split by topic\n" + "\n".join(long)
    )


def test_the_overview_links_every_design_page():
    overview = OVERVIEW.read_text()
    pages = sorted(page.name for page in DESIGN_DIR.glob("*.md"))
    assert pages, "docs/design/ holds the design pages"
    assert [name for name in pages if f"(design/{name})" not in overview] == []
