"""Per-instance circuit breakers: stop sending requests to an instance that keeps failing.

                                       cooldown_s elapsed, or a passed /health
    closed ──N consecutive failures──► open ─────────────────────────────────► half_open
      ▲                                  ▲                                        │ up to
      │                                  └──────────── a trial call fails ────────┤ half_open_calls
      └──────────────────────────────── a trial call succeeds ────────────────────┘ trial calls

A failure is what the instance is to blame for: a transport error (refused, reset, timed out)
or a 5xx answer. A 4xx is the client's fault and counts as a success (the instance answered
sensibly), except a 401: the worker refused the router (a deployment error), which says
nothing of the instance and gives no verdict (orchestrator.failures decides each verdict).
While open, the orchestrator skips the instance. Half-open admits a bounded number of
concurrent trial calls, not one probe: a burst that arrives right after an incident would
otherwise get 503 for everything but that probe although the instance is well. The
first trial's success closes the breaker; a failed trial opens it again. A passed health check
moves an open breaker to half-open at once: the instance answers, so its past failures no
longer justify refusing everyone (a passed check is not enough to close it: /health answers
while an engine may still fail every request). A request that finds every candidate half-open
with its trials busy (or open on an instance the checks call healthy) waits, bounded by
trial_wait_s, for a trial to end (`BreakerBoard.wait_for_change`) instead of getting 503.

Plain state driven by an injectable clock, so tests step time exactly; the router's event
loop is the only caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from pdrouter.common.flags import flag

if TYPE_CHECKING:
    from pdrouter.router.instances.instance import Instance


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Gauge values for /metrics (0 = closed is the healthy value).
STATE_TO_GAUGE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = field(
        default=5,
        metadata=flag(
            "--breaker-failures",
            "consecutive transport errors or 5xx answers that open an "
            "instance's circuit breaker (4xx never count)",
        ),
    )
    cooldown_s: float = field(
        default=5.0,
        metadata=flag(
            "--breaker-cooldown-s",
            "how long an open breaker skips its instance before it lets "
            "trial calls through (a passed health check ends it sooner)",
        ),
    )
    half_open_calls: int = field(
        default=8,
        metadata=flag(
            "--breaker-half-open-calls",
            "trial calls a half-open breaker lets through at once; "
            "the first that succeeds closes it",
        ),
    )
    trial_wait_s: float = field(
        default=2.0,
        metadata=flag(
            "--breaker-trial-wait-s",
            "how long a request waits for a trial slot of a half-open breaker before 503",
        ),
    )

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if self.half_open_calls < 1:
            raise ValueError(f"half_open_calls must be >= 1, got {self.half_open_calls}")
        if self.trial_wait_s < 0:
            raise ValueError(f"trial_wait_s must be >= 0, got {self.trial_wait_s}")


class CircuitBreaker:
    """One instance's breaker. allow() before a call, then record_success/record_failure
    (or release_trial when the call ended with no verdict)."""

    def __init__(
        self,
        cfg: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        # Called when a call may newly be let through (a trial ended, half-open, closed).
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at_s: float | None = None
        # Trial calls in flight while half-open. A trial taken in an earlier half-open period
        # that ends in a later one frees a slot it did not take: the bound stays within one
        # call of half_open_calls, never a refusal.
        self.trials_in_flight = 0
        self.times_opened = 0

    def _current_state(self) -> BreakerState:
        if self.state is BreakerState.OPEN:
            assert self.opened_at_s is not None
            if self._clock() - self.opened_at_s >= self.cfg.cooldown_s:
                self._half_open()
        return self.state

    def available(self) -> bool:
        """Whether allow() would let a call through now (does not take a trial slot)."""
        if self.state is BreakerState.CLOSED:  # stays closed until a failure: no clock read
            return True
        state = self._current_state()
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and self.trials_in_flight < self.cfg.half_open_calls

    def allow(self) -> bool:
        """Whether a call may go to the instance now; in half-open, takes a trial slot."""
        if not self.available():
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.trials_in_flight += 1
        return True

    def record_success(self) -> None:
        self._current_state()
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            # A trial (or a call started before the breaker opened) succeeded.
            self.state = BreakerState.CLOSED
            self.opened_at_s = None
            self.trials_in_flight = 0
            self._changed()

    def record_failure(self) -> None:
        state = self._current_state()
        self.consecutive_failures += 1
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.consecutive_failures >= self.cfg.failure_threshold
        ):
            self._open()
        # Already open: a call started before it opened failed late; the cooldown stands.

    def release_trial(self) -> None:
        """A call ended with no verdict (the client left, or a 401): its trial slot is free
        again."""
        if self.state is BreakerState.HALF_OPEN and self.trials_in_flight > 0:
            self.trials_in_flight -= 1
            self._changed()

    def health_passed(self) -> None:
        """The instance passed a health check: an open breaker goes half-open now."""
        if self._current_state() is BreakerState.OPEN:
            self._half_open()

    def _half_open(self) -> None:
        self.state = BreakerState.HALF_OPEN
        self.trials_in_flight = 0
        self._changed()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened_at_s = self._clock()
        self.trials_in_flight = 0
        self.times_opened += 1

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()


class BreakerBoard:
    """One breaker per instance URL, made on first use; one board per router."""

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self._url_to_breaker: dict[str, CircuitBreaker] = {}
        # Set (and replaced) whenever some breaker may let a call through that it refused.
        self._change = asyncio.Event()

    def get(self, url: str) -> CircuitBreaker:
        breaker = self._url_to_breaker.get(url)
        if breaker is None:
            breaker = CircuitBreaker(self.cfg, self._clock, self._notify)
            self._url_to_breaker[url] = breaker
        return breaker

    def available(self, insts: Sequence[Instance]) -> list[Instance]:
        """The instances whose breaker would let a call through now (see
        CircuitBreaker.available), in order; an instance without a breaker yet has a closed
        one."""
        out = []
        for inst in insts:
            breaker = self._url_to_breaker.get(inst.url)
            if breaker is None or breaker.available():
                out.append(inst)
        return out

    def worth_waiting(self, insts: Sequence[Instance]) -> bool:
        """Whether a refused call soon gets a slot from one of insts: a half-open breaker (a
        trial ends) or an open one whose instance the health checks call healthy (the next
        passed check makes it half-open)."""
        for inst in insts:
            state = self.state(inst.url)
            if state is BreakerState.HALF_OPEN or (state is BreakerState.OPEN and inst.healthy):
                return True
        return False

    async def wait_for_change(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until some breaker may let a call through that it
        refused before; False on timeout."""
        try:
            await asyncio.wait_for(self._change.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _notify(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def health_passed(self, url: str) -> None:
        """An instance passed a health check (see CircuitBreaker.health_passed)."""
        breaker = self._url_to_breaker.get(url)
        if breaker is not None:
            breaker.health_passed()

    def state(self, url: str) -> BreakerState:
        breaker = self._url_to_breaker.get(url)
        return BreakerState.CLOSED if breaker is None else breaker._current_state()

    def forget(self, url: str) -> None:
        """Drop an instance's breaker (it was removed from the registry)."""
        self._url_to_breaker.pop(url, None)
