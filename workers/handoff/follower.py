"""One thread that follows P's writes for every request a D has reserved blocks for.

    each tick (every poll_s, or at once after a tick that read something):
      one exists() batch over the next group of keys of every live follow
      per follow, the run of present keys from its first unread one
        -> read_run (workers/handoff/follow.py: the group pipeline, never a block whose
           put is in flight), one follow after another, the most urgent first (the
           request's priority, lower first; arrival order among equals)
      a follow ends (its Future resolves with a ReadOutcome) when every key is read, when it
      is stopped, at its deadline, or when a read raises (the error is its result)

follow_blocks follows one request in a thread of its own; a D with many reservations would
then poll once per request per poll_s (an exists() costs 0.3-0.5 ms on the 2-core VM: 200
waiting requests at 5 ms would be 40,000 calls a second) and hold one thread each. Here the
poll costs one call per tick however many requests wait, and the reads run on this one
thread, so they never take the threads the decode's own loads use.

Stopping: stop(follow) wakes the thread; a follow stopped while another one's read runs
waits for that read (a get of at most one group) and no more: stopped follows are ended
before each read, never a poll interval later. Every copy a
follow started has completed when its Future resolves.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.handoff.follow import read_run
from workers.handoff.reader import ReadOutcome
from workers.handoff.slots import HandoffPool
from workers.handoff.timings import ReadTimings
from workers.pool.errors import PoolError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Follow:
    """One request's keys, the blocks they go to, and how far the reading got."""

    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    deadline_s: float | None
    priority: int = 0  # the request's: lower is read first
    stop: threading.Event = field(default_factory=threading.Event)
    done: concurrent.futures.Future[ReadOutcome] = field(default_factory=concurrent.futures.Future)
    num_loaded: int = 0
    timings: ReadTimings = field(default_factory=ReadTimings)

    def outcome(self, slot_bytes: int) -> ReadOutcome:
        n = self.num_loaded
        return ReadOutcome(n, self.keys[n:], n * slot_bytes, self.timings)


class Follower:
    """Follows many requests' keys on one daemon thread (started with the first follow)."""

    def __init__(
        self,
        pool: Callable[[], HandoffPool],
        kv_caches: Sequence[object],
        *,
        group_blocks: int,
        wait_s: float,
        poll_s: float,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self._pool, self._caches = pool, kv_caches
        self._group, self._wait_s, self._poll_s = group_blocks, wait_s, poll_s
        self._follows: list[Follow] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(
        self,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline_s: float | None,
        priority: int = 0,
    ) -> Follow:
        """Start following keys into block_ids (time.monotonic deadline_s); a follow of a
        lower priority value is read before the others each tick."""
        if len(block_ids) < len(keys):
            raise ValueError(f"{len(block_ids)} block ids for {len(keys)} keys")
        follow = Follow(tuple(keys), tuple(block_ids), deadline_s, priority)
        with self._lock:
            self._follows.append(follow)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-follower", daemon=True)
                self._thread.start()
        self._wake.set()
        return follow

    def stop(self, follow: Follow) -> None:
        """Tell follow to end; its Future resolves once its reads in flight completed."""
        follow.stop.set()
        self._wake.set()

    def _end(self, follow: Follow, error: BaseException | None = None) -> None:
        with self._lock:
            self._follows.remove(follow)
        if error is not None:
            follow.done.set_exception(error)
        else:
            follow.done.set_result(follow.outcome(self._pool().config.slot_bytes))

    def _end_stopped(self, follows: list[Follow]) -> None:
        for follow in follows:
            if follow.stop.is_set() and not follow.done.done():
                self._end(follow)

    def _over(self, follow: Follow) -> bool:
        if follow.stop.is_set() or follow.num_loaded == len(follow.keys):
            return True
        return follow.deadline_s is not None and time.monotonic() >= follow.deadline_s

    def _run(self) -> None:
        while True:
            self._wake.wait(self._poll_s)
            self._wake.clear()
            with self._lock:
                follows = list(self._follows)
            try:
                if self._tick(follows):
                    self._wake.set()  # progress: look again at once
            except Exception:  # never let the thread die: every follow ends with the error
                log.exception("following P's writes failed")
                for follow in follows:
                    if not follow.done.done():
                        self._end(follow, RuntimeError("the follower failed"))

    def _tick(self, follows: list[Follow]) -> bool:
        """One round: ends what is over, asks the pool once, reads what is there."""
        live = []
        for follow in follows:
            if self._over(follow):
                self._end(follow)
            else:
                live.append(follow)
        if not live:
            return False
        live.sort(key=lambda follow: follow.priority)  # stable: arrival order among equals
        windows = [f.keys[f.num_loaded : f.num_loaded + self._group] for f in live]
        pool = self._pool()
        try:
            present = pool.exists([k for w in windows for k in w])
        except PoolError as exc:  # a sick pool: ask again next tick
            log.debug("exists failed while following: %s", exc)
            return False
        progress, start = False, 0
        for follow, window in zip(live, windows, strict=True):
            here = present[start : start + len(window)]
            start += len(window)
            self._end_stopped(live)  # a decode waiting on one never waits for others' reads
            if follow.done.done():
                continue
            ready = next((i for i, h in enumerate(here) if not h), len(here))
            if ready:
                part = range(follow.num_loaded, follow.num_loaded + ready)
                try:
                    out = read_run(
                        pool,
                        self._caches,
                        follow.keys,
                        follow.block_ids,
                        part,
                        self._group,
                        self._wait_s,
                        follow.deadline_s,
                    )
                except Exception as exc:  # staging_full, ...: the decode reads it all
                    self._end(follow, exc)
                    continue
                follow.num_loaded += out.num_loaded
                follow.timings += out.timings
                progress = progress or out.num_loaded > 0
            if self._over(follow):
                self._end(follow)
        return progress
