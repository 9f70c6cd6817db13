"""Every other rank's pool client in rank 0's /health.

Ranks 1..N-1 each hold a pool client of their own (workers/engine/tp/peer.py) that can lose
the pool and reconnect by itself as rank 0's does (workers/pool/pool_health.py). A rank whose
client is degraded, or that does not answer, cannot move its heads: every handoff would fail
or be recomputed. So rank 0 asks each rank for its client's health every interval_s, on a
thread of its own (the /health handler reads the last answers and never waits on a rank),
and ShardedPool.health reports the worker degraded while any rank is.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from workers.engine.tp.handoff_link import PeerCallError, PeerLinks

log = logging.getLogger(__name__)


class RankHealth:
    def __init__(self, peers: PeerLinks, interval_s: float) -> None:
        self.peers, self.interval_s = peers, interval_s
        # An answer takes longer than this only when the rank is stopped or swamped.
        self.answer_s = max(2.0, 2 * interval_s)
        self._problem: str | None = None
        self._stop = threading.Event()
        # The last poll's calls: a rank that is stopped holds its call (its handshake never
        # ends); the next polls wait on that one instead of piling up more behind it.
        self._pending: list[concurrent.futures.Future[Any]] = []

    def start(self) -> RankHealth:
        """Ask once now (the worker's first /health already knows), then every interval."""
        self.poll_once()
        threading.Thread(target=self._run, name="tp-rank-health", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def problem(self) -> str | None:
        """Why some rank's pool cannot serve (each such rank named), or None."""
        return self._problem

    def poll_once(self) -> str | None:
        if all(f.done() for f in self._pending):
            self._pending = self.peers.submit("health", bound_s=self.answer_s)
        # The calls' own bound first (a rank that hangs in the handler answers PeerCallError).
        concurrent.futures.wait(self._pending, timeout=self.answer_s + 1.0)
        reasons = []
        for rank, future in enumerate(self._pending, start=1):
            if not future.done():  # stuck before the call was even sent (a stopped process)
                reasons.append(f"rank {rank}: no answer to its pool health call")
                continue
            try:
                state, reason = future.result()
            except PeerCallError as exc:  # gone, failed, or no answer within answer_s
                reasons.append(f"rank {rank}: {exc}")
                continue
            if state != "ok":
                reasons.append(f"rank {rank}: {reason}")
        problem = "; ".join(reasons) or None
        if problem != self._problem:
            log.warning("ranks' pool clients: %s", problem or "all healthy again")
        self._problem = problem
        return problem

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception:  # the thread must outlive any surprise; the next tick retries
                log.exception("rank health poll failed")
