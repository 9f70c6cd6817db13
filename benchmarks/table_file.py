"""Writing a benchmark's Markdown table: to its file (folders made) and to stdout."""

from __future__ import annotations

from pathlib import Path


def publish(out: str | Path, table: str) -> None:
    """Print table, and write it to out unless out is empty."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table)
    print(table)


def section_markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(
    out: str | Path, block: str, begin: str, end: str, title: str | None = None
) -> None:
    """Put block (which starts with begin and ends with end) in out in place of the text
    between those markers, keeping everything else (other sections, prose written by hand).
    A file without them gets block at its end; a new or empty one, under `# title`."""
    path = Path(out)
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old.split(begin, 1)[1]:
        head, rest = old.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif old.strip():
        text = old.rstrip("\n") + "\n\n" + block + "\n"
    else:
        text = (f"# {title}\n\n" if title else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish_section(out: str | Path, name: str, table: str) -> None:
    """Print table and write it as section `name` of out (write_section)."""
    begin, end = section_markers(name)
    write_section(out, f"{begin}\n{table.rstrip()}\n{end}", begin, end)
    print(table)
