"""BoundedCaller: run a blocking native call so that the caller waits at most timeout_s.

Mooncake's calls cannot be cancelled and some block for seconds (about 4 s per call while the
master is down, longer on a hung owner). Each call runs on a daemon worker thread; the caller
waits for it with a timeout. A call that outlives its bound keeps running on its thread (the
native code releases the GIL while it waits), so the caller is told, the thread finishes later,
and on_done runs then: that is where the client unpins the staging slots it used.

The hand-off is on the data path of every batch (a 64 x 64 KiB get over shared memory takes
about 1 ms), so it is three raw locks per worker and no allocation per call:

    caller                                   worker
    ------                                   ------
    fn -> worker.fn; go.release()  ───────►  go.acquire() wakes; value = fn()
    done.acquire(timeout_s)                  claim.acquire(blocking=False):
      in time:  read value, on_done(),         won:  done.release()  ───► caller wakes
                claim.release(), park worker   lost: the caller gave up: on_done(),
      timeout:  claim.acquire(blocking=False)        claim.release(), park itself
                  won:  abandon, raise PoolTimeoutError
                  lost: the worker just finished; done.acquire(), as "in time"

claim is the one atomic decision between "the caller takes the result" and "the caller gave
up", so on_done runs exactly once, on whichever side sees the end last. Idle workers are kept
for reuse: a hand-off to a waiting thread costs two thread wake-ups, starting a thread ~150 us.

Two limits, documented rather than hidden:
- A native call that holds the GIL (Mooncake's setup() does) stalls the waiting thread too;
  the client keeps setup short with preflight checks and MC_STORE_CLIENT_SETUP_RETRIES=1.
- Daemon threads do not keep the interpreter alive, so a hung call never blocks exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from workers.pool.errors import PoolTimeoutError

T = TypeVar("T")
log = logging.getLogger(__name__)

# Idle workers kept for reuse; beyond this, a worker that finishes exits. Workers stuck in a
# hung call are not idle, so they never block new calls: a new worker takes those.
MAX_IDLE_WORKERS = 4


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class _Worker(threading.Thread):
    """One daemon thread running one call at a time, handed over through raw locks."""

    def __init__(self, caller: BoundedCaller, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.caller = caller
        self.go = _held_lock()  # released by the caller once fn is set
        self.done = _held_lock()  # released by the worker when the waiting caller may read
        self.claim = threading.Lock()  # taken first by the worker (in time) or caller (gave up)
        # One call's state, written before go is released, cleared before the worker is parked.
        self.fn: Callable[[], Any] | None = None
        self.on_done: Callable[[], None] | None = None
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        init = self.caller.thread_init
        if init is not None:
            try:
                init()
            except Exception:  # the calls still run; what they need of it fails visibly
                log.exception("thread start hook of %s failed", self.name)
        while True:
            self.go.acquire()
            fn = self.fn
            if fn is None:  # told to exit
                return
            try:
                self.value = fn()
            except BaseException as exc:  # re-raised on the caller's thread
                self.error = exc
            if self.claim.acquire(blocking=False):
                self.done.release()  # the caller reads the result and parks this worker
                continue
            # The caller gave up on this call: finish it here and return to the pool.
            on_done = self.on_done
            self.fn = self.on_done = self.value = self.error = None
            self.claim.release()
            try:
                if on_done is not None:
                    on_done()
            except Exception:  # nobody waits for this call any more: log, keep the worker
                log.exception("on_done of a call its caller gave up on failed")
            if not self.caller._park(self, abandoned=True):
                return


class BoundedCaller:
    """Runs callables on daemon worker threads with a wait bound; counts calls in flight."""

    def __init__(
        self, name: str = "pool-call", thread_init: Callable[[], None] | None = None
    ) -> None:
        """thread_init runs once on each worker thread before its first call (the pool
        client makes the CUDA device current there: workers/pool/device_staging.py)."""
        self._name = name
        self.thread_init = thread_init
        self._lock = threading.Lock()
        self._idle_cond = threading.Condition(self._lock)  # for wait_idle(), rarely waited on
        self._idle_waiters = 0
        self._inflight = 0
        self._timeouts = 0
        self._idle: list[_Worker] = []

    @property
    def inflight(self) -> int:
        """Calls started and not yet returned (including ones whose caller gave up)."""
        with self._lock:
            return self._inflight

    @property
    def num_timeouts(self) -> int:
        with self._lock:
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
        last: the caller's if fn finished in time, the worker's if not (and on the caller's,
        before the error, if no thread could be started). An exception that interrupts the
        wait (KeyboardInterrupt) leaves the call to its worker the same way as a timeout.
        """
        wait_s = min(max(0.0, timeout_s), threading.TIMEOUT_MAX)
        with self._lock:
            self._inflight += 1
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            try:
                worker = _Worker(self, self._name)
                worker.start()
            except BaseException:  # no thread (resource limits): fn never runs
                with self._lock:
                    self._inflight -= 1
                if on_done is not None:
                    on_done()
                raise
        worker.fn = fn
        worker.on_done = on_done
        worker.go.release()
        # From here to the acquire, nothing: the worker wakes wanting the GIL we hold.
        interrupted: BaseException | None = None
        try:
            finished = worker.done.acquire(True, wait_s)
        except BaseException as exc:
            finished, interrupted = False, exc
        if not finished:
            if worker.claim.acquire(blocking=False):
                # fn is still running: the worker runs on_done and parks itself when it ends.
                if interrupted is not None:
                    raise interrupted
                with self._lock:
                    self._timeouts += 1
                raise PoolTimeoutError(f"{what} did not return within {timeout_s:.1f}s")
            worker.done.acquire()  # fn ended just now; the worker is releasing done
        value, error = worker.value, worker.error
        worker.fn = worker.on_done = worker.value = worker.error = None
        worker.claim.release()
        try:
            if on_done is not None:
                on_done()
        finally:
            self._park(worker, abandoned=False)
        if interrupted is not None:
            raise interrupted
        if error is not None:
            raise error
        return value

    def _park(self, worker: _Worker, abandoned: bool) -> bool:
        """A worker's call ended: keep the worker for the next call, or tell it to exit."""
        with self._lock:
            self._inflight -= 1
            if self._idle_waiters and not self._inflight:
                self._idle_cond.notify_all()
            if len(self._idle) < MAX_IDLE_WORKERS:
                self._idle.append(worker)
                return True
        if not abandoned:  # the worker waits on go: wake it with no call, so that it exits
            worker.go.release()
        return False

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if some still are after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._idle_waiters += 1
            try:
                while self._inflight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle_cond.wait(left)
                return True
            finally:
                self._idle_waiters -= 1
