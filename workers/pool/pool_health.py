"""The pool client's health: a background probe, the degraded state, and reconnection.

Why a client can lose the pool without any process dying (Mooncake 0.3.13, same-host shared
memory): the owner's `mooncake_client` keeps a table of its shared-memory clients, refreshed by
each client's ping (once a second, from a thread inside the client's own process). An entry
not refreshed for 10 s (DEFAULT_CLIENT_LIVE_TTL_SEC, fixed in the owner, not the master's
--client_ttl) is dropped and that client's staging is unmapped. A worker stopped for more than
about 10 s (SIGSTOP, a long GC or swap storm), or an owner stopped that long whose clock jumps
when it resumes, so loses its mapping. The client's ping thread then succeeds again (a ping
re-adds the id to the table and answers OK) and never learns that its staging is gone: every
put/get answers -600 (shm_not_mapped) for good. A fresh client id with a freshly allocated and
registered staging is mapped again; registering the old staging once more is not possible (the
client process marks it registered and skips the owner).

So the monitor probes the pool every probe_interval_s with a get of a key that never exists
into the staging (answers -704 when all is well, -600 when the mapping is gone, -800/-900
when the owner or master is down, nothing within probe_timeout_s when the owner hangs), and
a data call that fails with one of those codes wakes it at once. A failed probe marks the
client degraded: health() says so with the reason, the calls fail fast (UNAVAILABLE) so that
requests take the recompute path, one log line and the gauge say so. It then reconnects (a
new store, staging, registration, warm-up: KVPoolClient._reconnect) once the pool answers
again, never while the owner hangs: Mooncake's setup holds the GIL, so a setup against a
stopped owner would stop the whole worker with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("workers.pool.client")


@dataclass(frozen=True)
class PoolHealth:
    """What /health reports of the pool client: "ok", or "degraded" and why."""

    state: str  # "ok" | "degraded"
    reason: str | None = None
    generation: int = 0  # connections made so far after the first (reconnections)

    @property
    def ok(self) -> bool:
        return self.state == "ok"


@dataclass(frozen=True)
class ProbeOutcome:
    """One probe: reason None when the pool answered as it should; reachable says whether a
    reconnection may be tried now (the owner and master answer, nothing hangs)."""

    reason: str | None
    reachable: bool = True


class _Gauges:
    """pdworker_pool_degraded and pdworker_pool_reconnects_total on the given registry."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.degraded = Gauge(
            "pdworker_pool_degraded",
            "1 while the pool client cannot reach the pool (calls fail fast, requests recompute)",
            registry=registry,
        )
        self.reconnects = Counter(
            "pdworker_pool_reconnects",
            "times the pool client set itself up again after losing the pool",
            registry=registry,
        )


class HealthMonitor:
    """The probe thread: ok <-> degraded transitions, each logged once, and the reconnects."""

    def __init__(
        self,
        probe: Callable[[], ProbeOutcome],
        reconnect: Callable[[], bool],
        interval_s: float,
        max_reconnects: int,
        registry: Any = None,
    ) -> None:
        self._probe, self._reconnect = probe, reconnect
        self._interval_s = interval_s
        self._max_reconnects = max_reconnects
        self._gauges = _Gauges(registry) if registry is not None else None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reason: str | None = None
        self._since = 0.0
        self._generation = 0
        self._thread: threading.Thread | None = None

    @property
    def degraded(self) -> bool:
        return self._reason is not None  # one attribute read: on every data call

    def health(self) -> PoolHealth:
        reason = self._reason
        state = "ok" if reason is None else "degraded"
        return PoolHealth(state, reason, self._generation)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def poke(self) -> None:
        """A data call failed as a lost pool would: probe now rather than at the next tick."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check_once()
            except Exception:  # the thread must outlive any surprise; the next tick retries
                log.exception("pool health check failed")

    def check_once(self) -> PoolHealth:
        """Probe; on failure mark degraded and reconnect if the pool answers again."""
        outcome = self._probe()
        if outcome.reason is None:
            self._set_ok(reconnected=False)
            return self.health()
        self._set_degraded(outcome.reason)
        if not outcome.reachable:
            return self.health()
        if self._generation >= self._max_reconnects:
            self._set_degraded(f"{outcome.reason}; gave up after {self._max_reconnects} reconnects")
            return self.health()
        if self._reconnect():
            self._generation += 1
            if self._gauges is not None:
                self._gauges.reconnects.inc()
            if self._probe().reason is None:
                self._set_ok(reconnected=True)
        return self.health()

    def _set_degraded(self, reason: str) -> None:
        if self._reason is None:
            self._since = time.monotonic()
            log.warning("pool client degraded (requests recompute until it reconnects): %s", reason)
            if self._gauges is not None:
                self._gauges.degraded.set(1)
        self._reason = reason

    def _set_ok(self, reconnected: bool) -> None:
        if self._reason is None:
            return
        how = f"reconnected (generation {self._generation})" if reconnected else "answers again"
        log.warning(
            "pool client healthy again after %.1f s: %s", time.monotonic() - self._since, how
        )
        self._reason = None
        if self._gauges is not None:
            self._gauges.degraded.set(0)
