"""CPU pinning of the launcher's children by role (`pdrouter launch --cpu-affinity`).

    --cpu-affinity 'prefill=0 decode=1 router=1 pool=1'

A role is prefill, decode, mixed (every worker of that role), router, or pool (the metadata
store, the master and the pool owner); its CPUs are a list as taskset(1) reads it (0,2-3).
A pinned child starts under `taskset -c CPUS`, which execs it: the same pid, and every thread
and process it starts (TP ranks included) inherits the mask. A role not named runs on every
CPU. It stands for a deployment where a role has hardware of its own (P with a device to
itself) on a host that has fewer cores than processes.
"""

from __future__ import annotations

import re

ROLES = ("prefill", "decode", "mixed", "router", "pool")
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_WORKER_NAME = re.compile(r"^(prefill|decode|mixed)-\d+$")


def parse_affinity(text: str) -> tuple[tuple[str, str], ...]:
    """'ROLE=CPUS ...' -> ((role, cpus), ...); ValueError (one line) for a bad one."""
    pairs: dict[str, str] = {}
    for item in text.split():
        role, sep, cpus = item.partition("=")
        if not sep or role not in ROLES:
            raise ValueError(f"{item!r}: give ROLE=CPUS, ROLE one of {', '.join(ROLES)}")
        if not _CPU_LIST.match(cpus):
            raise ValueError(f"{item!r}: CPUS is a list such as 0 or 0,2-3")
        if role in pairs:
            raise ValueError(f"{role} is pinned twice")
        pairs[role] = cpus
    return tuple(pairs.items())


def role_of(child_name: str) -> str:
    """The pinning role of a launcher child by its name (prefill-0, router, pool-owner...)."""
    match = _WORKER_NAME.match(child_name)
    if match:
        return match.group(1)
    return "router" if child_name == "router" else "pool"


def pinned_argv(
    argv: list[str], child_name: str, affinity: tuple[tuple[str, str], ...]
) -> list[str]:
    """argv under `taskset -c CPUS` when the child's role is pinned, else argv."""
    cpus = dict(affinity).get(role_of(child_name))
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]
