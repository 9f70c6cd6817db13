"""Writing a benchmark's Markdown table: to its file (folders made) and to stdout."""

from __future__ import annotations

from pathlib import Path


def publish(out: str | Path, table: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(table)
