"""What the pool owner's process did during a measured interval, read from /proc.

Over shared memory every byte a client puts or gets is copied by the owner's `mooncake_client`
process, not by the client. Sampling it before and after a put tells where the time went:

    minor_faults   pages the owner faulted in (first touch of its never-used segment)
    cpu_s          CPU seconds of all its threads
    busiest_s      CPU seconds of its busiest thread (== wall time: one thread does the copying)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str]:
    # The command name may hold spaces: fields start after its closing parenthesis.
    text = path.read_text()
    return text[text.rindex(")") + 2 :].split()


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (from /proc/*/stat, which every kernel has)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(entry / "stat")[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return sorted(found)


def mooncake_client_pid(owner_pid: int) -> int | None:
    """The `mooncake_client` child of a `pdworker pool` process, or None."""
    for child in child_pids(owner_pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip().startswith("mooncake_client"):
                return child
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class ProcSample:
    minor_faults: int
    cpu_s: float
    thread_cpu_s: dict[int, float]
    anon_huge_kib: int


def sample(pid: int) -> ProcSample | None:
    """A snapshot of pid's counters; None if it is gone or unreadable."""
    base = Path(f"/proc/{pid}")
    try:
        fields = _stat_fields(base / "stat")
        threads = {}
        for task in (base / "task").iterdir():
            try:
                tf = _stat_fields(task / "stat")
                threads[int(task.name)] = (int(tf[11]) + int(tf[12])) * _TICK_S
            except (OSError, ValueError, IndexError):
                continue
        huge_kib = 0
        try:
            for line in (base / "smaps_rollup").read_text().splitlines():
                if line.startswith("AnonHugePages:"):
                    huge_kib = int(line.split()[1])
        except OSError:
            pass
        return ProcSample(
            int(fields[7]), (int(fields[11]) + int(fields[12])) * _TICK_S, threads, huge_kib
        )
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ProcDelta:
    minor_faults: int
    cpu_s: float
    busiest_s: float
    anon_huge_kib: int

    def as_dict(self) -> dict[str, float]:
        return {
            "owner_faults": self.minor_faults,
            "owner_cpu_s": self.cpu_s,
            "owner_busiest_s": self.busiest_s,
            "owner_thp_kib": self.anon_huge_kib,
        }


def delta(before: ProcSample | None, after: ProcSample | None) -> ProcDelta | None:
    if before is None or after is None:
        return None
    busiest = max(
        (cpu - before.thread_cpu_s.get(tid, 0.0) for tid, cpu in after.thread_cpu_s.items()),
        default=0.0,
    )
    return ProcDelta(
        after.minor_faults - before.minor_faults,
        after.cpu_s - before.cpu_s,
        busiest,
        after.anon_huge_kib,
    )
