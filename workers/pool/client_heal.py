"""The self-healing half of KVPoolClient: its probe, its reconnect, its health.

SelfHealing is a mixin of KVPoolClient (workers/pool/client.py), split out to keep each file
to one concern; it uses the client's lock, state and link. Why and how the client heals:
workers/pool/pool_health.py; what one connection holds: workers/pool/pool_link.py.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from workers.pool.client_config import PoolClientConfig, PoolCounters
from workers.pool.errors import TIMEOUT_CODE, BatchResult, PoolError
from workers.pool.pool_health import HealthMonitor, PoolHealth, ProbeOutcome
from workers.pool.pool_link import Link, close_link, open_link, probe_link
from workers.pool.warm_staging import warm_staging

if TYPE_CHECKING:
    from workers.pool.bounded_call import BoundedCaller
    from workers.pool.page_lock import Register

log = logging.getLogger("workers.pool.client")

# Codes a lost pool answers (shm_not_mapped, transfer failed, master unreachable, our own
# timeout): a data call that sees one wakes the probe rather than waiting for its tick.
_LOST_POOL_CODES = frozenset({-600, -800, -900, TIMEOUT_CODE})


class SelfHealing:
    """health(), the probe and the reconnect of a KVPoolClient."""

    config: PoolClientConfig
    _lock: threading.Lock
    _cond: threading.Condition
    _state: str
    _active: int
    _link: Link | None
    _retired: list[Link]
    _monitor: HealthMonitor
    _probing: bool
    _probe_caller: BoundedCaller
    _register: Register
    _counts: PoolCounters

    def _exit(self) -> None: ...  # KVPoolClient's

    def health(self) -> PoolHealth:
        """ "ok", or "degraded" with the reason (calls fail fast meanwhile): for /health."""
        return self._monitor.health()

    def _warm(self) -> None:
        """Warm the owner's view of the staging (shared memory); counters left as they were."""
        if self.config.owner_addr is None or not self.config.warm_staging:
            return
        counts = self._counts.snapshot()
        warm_staging(self)
        self._counts.restore(counts)  # counters count handoffs, not the warm-up

    def _notice(self, result: BatchResult) -> None:
        """Wake the probe when a call failed as a lost pool makes calls fail."""
        if not result.ok and not _LOST_POOL_CODES.isdisjoint(result.codes):
            self._monitor.poke()

    def _probe(self) -> ProbeOutcome:
        """The health probe on the current link (workers/pool/pool_link.py), at most one at a
        time: a probe stuck on a hung owner is not joined by another every tick."""
        with self._lock:
            if self._state != "open" or self._probing:
                return ProbeOutcome(self._monitor.health().reason, reachable=False)
            self._probing = True
            self._active += 1
            link = self._link
        try:
            assert link is not None
            return probe_link(link, self._probe_caller, self.config, self._probe_done)
        finally:
            self._exit()

    def _probe_done(self) -> None:
        with self._lock:
            self._probing = False

    def _reconnect(self) -> bool:
        """A new link (store, staging, registration) in place of the current one, which is
        kept (pool_link.py); False (still degraded) if the pool refused or we were closed."""
        with self._lock:
            generation = (self._link.generation + 1) if self._link is not None else 0
        try:
            link = open_link(self.config, self._probe_caller, self._register, generation)
        except PoolError as exc:
            log.info("pool client reconnect failed: %s", exc)
            return False
        with self._cond:
            if self._state != "open":
                close_link(link)  # nobody could have used it
                return False
            assert self._link is not None
            self._retired.append(self._link)
            self._link = link
        return True
