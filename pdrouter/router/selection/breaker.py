"""Per-instance circuit breakers: stop sending requests to an instance that keeps failing.

    closed ──N consecutive failures──► open ──cooldown_s elapsed──► half_open
      ▲                                  ▲                              │ one probe request
      └────────── probe succeeds ────────┼──────── probe fails ─────────┘

A failure is what the instance is to blame for: a transport error (refused, reset, timed out)
or a 5xx answer. A 4xx is the client's fault and counts as a success (the instance answered
sensibly). While open, the orchestrator skips the instance; after the cooldown exactly one
request is let through as a probe, and its outcome closes or re-opens the breaker.

Plain state driven by an injectable clock, so tests step time exactly; the router's event
loop is the only caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

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
    failure_threshold: int = 5  # consecutive failures that open a closed breaker
    cooldown_s: float = 5.0  # open this long before one probe request is let through

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")


def is_failure_status(status_code: int) -> bool:
    """Whether an HTTP answer counts against the instance (5xx yes, 4xx and 2xx no)."""
    return status_code >= 500


class CircuitBreaker:
    """One instance's breaker. allow() before a call, then record_success/record_failure."""

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at_s: float | None = None
        self.probe_in_flight = False
        self.times_opened = 0

    def _current_state(self) -> BreakerState:
        if self.state is BreakerState.OPEN:
            assert self.opened_at_s is not None
            if self._clock() - self.opened_at_s >= self.cfg.cooldown_s:
                self.state = BreakerState.HALF_OPEN
                self.probe_in_flight = False
        return self.state

    def available(self) -> bool:
        """Whether allow() would let a call through now (does not take the probe slot)."""
        if self.state is BreakerState.CLOSED:  # stays closed until a failure: no clock read
            return True
        state = self._current_state()
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self.probe_in_flight

    def allow(self) -> bool:
        """Whether a call may go to the instance now; in half-open, takes the one probe slot."""
        if not self.available():
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True
        return True

    def record_success(self) -> None:
        self._current_state()
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            # Only the probe (or a call started before the breaker opened) gets here.
            self.state = BreakerState.CLOSED
            self.opened_at_s = None
            self.probe_in_flight = False

    def record_failure(self) -> None:
        state = self._current_state()
        self.consecutive_failures += 1
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.consecutive_failures >= self.cfg.failure_threshold
        ):
            self._open()
        # Already open: a call started before it opened failed late; the cooldown stands.

    def release_probe(self) -> None:
        """The probe ended with no verdict (the client left): let the next request probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = False

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened_at_s = self._clock()
        self.probe_in_flight = False
        self.times_opened += 1


class BreakerBoard:
    """One breaker per instance URL, made on first use; one board per router."""

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self._url_to_breaker: dict[str, CircuitBreaker] = {}

    def get(self, url: str) -> CircuitBreaker:
        breaker = self._url_to_breaker.get(url)
        if breaker is None:
            breaker = self._url_to_breaker[url] = CircuitBreaker(self.cfg, self._clock)
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

    def state(self, url: str) -> BreakerState:
        breaker = self._url_to_breaker.get(url)
        return BreakerState.CLOSED if breaker is None else breaker._current_state()

    def forget(self, url: str) -> None:
        """Drop an instance's breaker (it was removed from the registry)."""
        self._url_to_breaker.pop(url, None)
