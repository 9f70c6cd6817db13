"""The CPU a benchmark ran on, as its table's Machine line names it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name(fallback: str | None = None) -> str:
    """The first "model name" of /proc/cpuinfo; where there is none, `fallback`, or else
    platform.processor() or platform.machine()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if fallback is not None:
        return fallback
    return platform.processor() or platform.machine()
