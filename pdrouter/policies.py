"""Instance selection policies: which prefill or decode instance takes the next request.

A policy only orders candidates; the orchestrator decides what a failure means and asks again
with the failed instance excluded. New policies (least_loaded, power_of_two) register in
POLICIES and read whatever load signal Instance carries (in_flight now).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from pdrouter.registry import Instance


class SelectionPolicy(Protocol):
    """Picks one instance from a non-empty list of candidates (all healthy, none excluded)."""

    name: str

    def pick(self, candidates: Sequence[Instance]) -> Instance: ...


class RoundRobin:
    """Cycles over candidates in the order given, skipping none; a counter per policy object."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        if not candidates:
            raise ValueError("RoundRobin.pick needs at least one candidate")
        return candidates[next(self._counter) % len(candidates)]


class LeastInFlight:
    """The candidate with the fewest requests in flight through this router (ties: list order)."""

    name = "least_in_flight"

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        if not candidates:
            raise ValueError("LeastInFlight.pick needs at least one candidate")
        return min(candidates, key=lambda inst: inst.in_flight)


POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastInFlight.name: LeastInFlight,
}


def make_policy(name: str) -> SelectionPolicy:
    """A fresh policy object by name; raises ValueError listing the known names."""
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown selection policy {name!r}; known: {known}") from None
    return factory()
