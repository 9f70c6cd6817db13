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


def publish_section(out: str | Path, name: str, table: str) -> None:
    """Write table between the markers of section `name` in out, keeping everything else (the
    other sections, text written by hand); a file without them gets the section at its end."""
    path = Path(out)
    begin, end = section_markers(name)
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table.rstrip()}\n{end}"
    if begin in old and end in old.split(begin, 1)[1]:
        head, rest = old.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(table)
