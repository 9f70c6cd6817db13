"""BoundedCaller: run a blocking native call so that the caller waits at most timeout_s.

Mooncake's calls cannot be cancelled and some block for seconds (about 4 s per call while the
master is down, longer on a hung owner). Each call runs on a daemon worker thread; the caller
waits on an event with a timeout. Workers are kept for reuse: handing a call to a waiting
thread costs ~50 us, starting one ~150 us (20% of a 64 x 64 KiB get over shared memory).
A call that outlives its bound keeps running on its thread (the native code releases the
GIL while it waits), so the caller is told, the thread finishes later, and on_done runs
then: that is where the client unpins the staging slots it used.

Two limits, documented rather than hidden:
- A native call that holds the GIL (Mooncake's setup() does) stalls the waiting thread too;
  the client keeps setup short with preflight checks and MC_STORE_CLIENT_SETUP_RETRIES=1.
- Daemon threads do not keep the interpreter alive, so a hung call never blocks exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from workers.pool.errors import PoolTimeoutError

T = TypeVar("T")

# Idle workers kept for reuse; beyond this, a worker that finishes exits. Workers stuck in a
# hung call are not idle, so they never block new calls: a new worker takes those.
MAX_IDLE_WORKERS = 4


class _Worker(threading.Thread):
    def __init__(self, caller: BoundedCaller, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.caller = caller
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            self.jobs.get()()
            if not self.caller._park(self):
                return


class BoundedCaller:
    """Runs callables on daemon worker threads with a wait bound; counts calls in flight."""

    def __init__(self, name: str = "pool-call") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._inflight = 0
        self._timeouts = 0
        self._idle: list[_Worker] = []

    @property
    def inflight(self) -> int:
        """Calls started and not yet returned (including ones whose caller gave up)."""
        with self._cond:
            return self._inflight

    @property
    def num_timeouts(self) -> int:
        with self._cond:
            return self._timeouts

    def call(
        self,
        fn: Callable[[], T],
        timeout_s: float,
        on_done: Callable[[], None] | None = None,
        what: str = "call",
    ) -> T:
        """fn() on a worker thread; raise PoolTimeoutError if it is not back in timeout_s.

        on_done runs exactly once after fn returns or raises, on whichever thread sees the end
        last: the caller's if fn finished in time, the worker's if not.
        """
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised on the caller's thread
                box["error"] = exc
            finally:
                with self._cond:
                    self._inflight -= 1
                    abandoned = box.setdefault("abandoned", False)
                    self._cond.notify_all()
                done.set()
                if abandoned and on_done is not None:
                    on_done()

        with self._cond:
            self._inflight += 1
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self, self._name)
            worker.start()
        worker.jobs.put(run)
        finished = done.wait(timeout_s)
        if not finished:
            with self._cond:
                # The worker may have finished between wait() and here: decide under the lock.
                if "abandoned" not in box:
                    box["abandoned"] = True
                    self._timeouts += 1
                    raise PoolTimeoutError(f"{what} did not return within {timeout_s:.1f}s")
            done.wait()
        if on_done is not None:
            on_done()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _park(self, worker: _Worker) -> bool:
        """A worker finished its call: keep it for the next one, or tell it to exit."""
        with self._cond:
            if len(self._idle) < MAX_IDLE_WORKERS:
                self._idle.append(worker)
                return True
            return False

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if some still are after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
