"""BoundedCaller: waits at most timeout_s, runs on_done exactly once, counts in-flight calls."""

from __future__ import annotations

import threading
import time

import pytest

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
