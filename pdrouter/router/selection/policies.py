"""Instance selection policies: which prefill or decode instance takes the next request.

A policy only orders candidates; the orchestrator filters them first (health, fingerprint,
circuit breaker, per-instance limit) and decides what a failure means. The load signal is what
this router holds on each instance (Instance.in_flight and Instance.in_flight_tokens), taken
when a call starts and given back when its answer ends: for decode that is when the client's
stream ends, not when D's headers arrive, so a long stream keeps counting.

    round_robin    cycle over the candidates
    least_loaded   fewest requests in flight, then fewest tokens in flight, then list order
    power_of_two   two distinct candidates drawn at random, the less loaded of them
                   (cheap, and avoids the herd that least_loaded sends to one idle instance
                   when several routers share a cluster)
    cache_aware    prefill: the P whose caches hold the most of the prompt's prefix (its
                   own events say so), less a penalty for its load (cache_aware.py)
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from pdrouter.router.instances.instance import Instance
from pdrouter.router.selection.admission import Admission
from pdrouter.router.selection.breaker import BreakerBoard
from pdrouter.router.selection.cache_aware import CacheAware, CacheRoutingConfig
from pdrouter.wire.errors import APIError


class SelectionPolicy(Protocol):
    """Picks one instance from a non-empty list of candidates (all usable, none excluded)."""

    name: str

    def pick(self, candidates: Sequence[Instance]) -> Instance: ...


def _require(candidates: Sequence[Instance], policy: str) -> None:
    if not candidates:
        raise ValueError(f"{policy}.pick needs at least one candidate")


def load_key(inst: Instance) -> tuple[int, int]:
    """The load order of least_loaded and power_of_two: requests, then tokens."""
    return inst.in_flight, inst.in_flight_tokens


class RoundRobin:
    """Cycles over candidates in the order given, skipping none; a counter per policy object."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        _require(candidates, "RoundRobin")
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded:
    """The candidate with the fewest requests in flight through this router, then the fewest
    tokens in flight (ties: list order)."""

    name = "least_loaded"

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        _require(candidates, "LeastLoaded")
        return min(candidates, key=load_key)


class LeastInFlight:
    """Fewest requests in flight only, ignoring tokens (the issue-5 policy, kept by name)."""

    name = "least_in_flight"

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        _require(candidates, "LeastInFlight")
        return min(candidates, key=lambda inst: inst.in_flight)


class PowerOfTwo:
    """Two distinct candidates at random, the less loaded (ties: the first drawn).

    rng is injectable so that tests fix the draws; one candidate is returned as is.
    """

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        _require(candidates, "PowerOfTwo")
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return b if load_key(b) < load_key(a) else a


POLICIES: dict[str, Callable[[], SelectionPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    LeastInFlight.name: LeastInFlight,
    PowerOfTwo.name: PowerOfTwo,
    CacheAware.name: CacheAware,
}


def make_policy(name: str, cache: CacheRoutingConfig | None = None) -> SelectionPolicy:
    """A fresh policy object by name (cache_aware with cache's settings); raises ValueError
    listing the known names."""
    if name == CacheAware.name:
        return CacheAware(cache)
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown selection policy {name!r}; known: {known}") from None
    return factory()


def choose(
    role: str,
    tiers: Sequence[Sequence[Instance]],
    policy: SelectionPolicy,
    breakers: BreakerBoard,
    admission: Admission,
    first_attempt: bool,
    body: bytes | None = None,
    cache_scope: str | None = None,
    bounded: bool = True,
    extra_calls: int = 0,
) -> Instance | None:
    """The instance a call goes to, from candidate tiers in order of preference.

    Instances whose breaker is open are skipped; the first tier with any left is the one the
    policy picks from, among those with room under the per-instance limit (when none has
    room and not bounded: among all). Raises 429 when that tier's instances are all at the
    limit, and 503 (Retry-After) on a request's first attempt when every candidate's breaker
    is open (BreakerBusy when waiting may help); None when nothing is left to try. The chosen
    instance's breaker is asked allow(), which takes a half-open trial slot. body and
    cache_scope are the request's, for a policy that reads the prompt (cache_aware);
    extra_calls the request's reserve past the per-instance limit (Admission.has_room).
    """
    any_candidate = False
    for tier in tiers:
        if not tier:
            continue
        any_candidate = True
        closed = breakers.available(tier)
        if not closed:
            continue
        with_room = admission.with_room(closed, extra_calls)
        if not with_room and not bounded:  # all full: still served, never refused here
            with_room = list(closed)
        if not with_room:
            raise admission.instances_full(role, closed)
        pick_for = getattr(policy, "pick_for", None)  # a policy that reads the prompt
        inst = (
            policy.pick(with_room)
            if body is None or pick_for is None
            else pick_for(with_room, body, cache_scope)
        )
        taken = breakers.get(inst.url).allow()
        assert taken, f"breaker of {inst.url} refused a call it reported available"
        return inst
    if any_candidate and first_attempt:
        error = BreakerBusy if any(breakers.worth_waiting(tier) for tier in tiers) else APIError
        raise error(
            503,
            f"no {role} instance available: the circuit breaker of every {role} instance is "
            f"open after repeated failures (cooldown {breakers.cfg.cooldown_s:g}s)",
            stage=role,
            retry_after_s=max(1, math.ceil(breakers.cfg.cooldown_s)),
        )
    return None


class BreakerBusy(APIError):
    """Every candidate's breaker refused, but one will soon let a call through (half-open with
    its trials busy, or open on an instance the checks call healthy): worth a bounded wait
    (Attempts.next) before this 503 reaches the client."""
