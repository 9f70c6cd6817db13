"""BoundedCaller: waits at most timeout_s, runs on_done exactly once, counts in-flight calls."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from workers.pool import bounded_call
from workers.pool.bounded_call import BoundedCaller
from workers.pool.errors import PoolTimeoutError


def test_returns_value_and_runs_on_done_on_the_caller():
    caller = BoundedCaller()
    done_on: list[str] = []
    value = caller.call(
        lambda: 42, 5.0, on_done=lambda: done_on.append(threading.current_thread().name)
    )
    assert value == 42
    assert done_on == [threading.current_thread().name]
    assert caller.inflight == 0 and caller.num_timeouts == 0


def test_exceptions_reach_the_caller_after_on_done():
    caller = BoundedCaller()
    done: list[int] = []

    def boom() -> None:
        raise RuntimeError("native failure")

    with pytest.raises(RuntimeError, match="native failure"):
        caller.call(boom, 5.0, on_done=lambda: done.append(1))
    assert done == [1]


def test_timeout_returns_early_and_on_done_runs_when_the_call_really_ends():
    caller = BoundedCaller()
    release = threading.Event()
    done = threading.Event()
    start = time.monotonic()
    with pytest.raises(PoolTimeoutError, match=r"slow op did not return within 0\.2s"):
        caller.call(release.wait, 0.2, on_done=done.set, what="slow op")
    assert time.monotonic() - start < 1.0
    assert caller.inflight == 1 and caller.num_timeouts == 1
    assert not done.is_set()  # the slots it used stay pinned while it runs
    assert not caller.wait_idle(0.05)
    release.set()
    assert done.wait(5.0)
    assert caller.wait_idle(5.0) and caller.inflight == 0


def test_concurrent_calls_do_not_wait_for_each_other():
    caller = BoundedCaller()
    release = threading.Event()
    with pytest.raises(PoolTimeoutError):
        caller.call(release.wait, 0.1)
    assert caller.call(lambda: "second", 1.0) == "second"  # not queued behind the stuck one
    release.set()
    assert caller.wait_idle(5.0)


def test_an_abandoned_worker_finishes_its_call_then_serves_the_next():
    caller = BoundedCaller()
    release = threading.Event()
    threads: list[threading.Thread] = []

    def slow() -> str:
        threads.append(threading.current_thread())
        release.wait()
        return "late"

    done = threading.Event()
    with pytest.raises(PoolTimeoutError):
        caller.call(slow, 0.05, on_done=done.set)
    release.set()
    assert done.wait(5.0) and caller.wait_idle(5.0)
    # The worker that ran the abandoned call parked itself and takes the next call; its late
    # value never leaks into that call.
    assert caller.call(lambda: threading.current_thread(), 5.0) is threads[0]
    assert caller.call(lambda: "fresh", 5.0) == "fresh"
    assert (caller.inflight, caller.num_timeouts) == (0, 1)


def test_calls_from_many_threads_each_get_their_own_value():
    caller = BoundedCaller()
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(8)

    def client(n: int) -> None:
        barrier.wait()
        results[n] = [caller.call(lambda i=i: n * 1000 + i, 5.0) for i in range(200)]

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {n: [n * 1000 + i for i in range(200)] for n in range(8)}
    assert (caller.inflight, caller.num_timeouts) == (0, 0)


class _Interrupted(Exception):
    pass


def test_an_interrupted_wait_leaves_the_call_to_its_worker():
    """A signal handler that raises while the caller waits (as KeyboardInterrupt does): the
    exception reaches the caller at once, on_done still waits for the call's real end."""
    assert threading.current_thread() is threading.main_thread()  # signals land here
    caller = BoundedCaller()
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    interrupted = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        if not interrupted.is_set():  # the first one raises; a spare one sent after, nothing
            interrupted.set()
            raise _Interrupted

    def fn() -> None:
        started.set()
        release.wait()

    def send_signal() -> None:
        # A signal that lands just before the main thread blocks in its wait is handled only
        # when the wait ends (seen once: the whole 30 s): send it again until it is handled.
        started.wait()
        while not interrupted.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            interrupted.wait(0.1)

    old = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=send_signal)
    try:
        sender.start()
        with pytest.raises(_Interrupted):
            caller.call(fn, 30.0, on_done=done.set)
    finally:
        sender.join(timeout=10)
        signal.signal(signal.SIGUSR1, old)
    assert not done.is_set() and caller.inflight == 1
    assert caller.num_timeouts == 0  # interrupted, not timed out
    release.set()
    assert done.wait(5.0) and caller.wait_idle(5.0)
    assert caller.call(lambda: "after", 5.0) == "after"


def test_on_done_runs_when_no_thread_can_be_started(monkeypatch):
    caller = BoundedCaller()

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(bounded_call._Worker, "start", refuse)  # resource limits, injected
    done: list[int] = []
    with pytest.raises(RuntimeError, match="can't start new thread"):
        caller.call(lambda: 1, 5.0, on_done=lambda: done.append(1))
    assert done == [1] and caller.inflight == 0
