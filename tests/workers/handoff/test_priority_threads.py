"""The handoff threads (workers.handoff.priority_threads): queued calls run most urgent first
(lower priority value), arrival order among equals; a running call is never interrupted; an
error goes to its caller and the thread serves on; a call cancelled before it started never
runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from workers.handoff.priority_threads import PriorityThreads


@pytest.fixture
def one_thread() -> Iterator[PriorityThreads]:
    threads = PriorityThreads(1, "test-handoff")
    yield threads
    threads.close()


def hold(threads: PriorityThreads) -> threading.Event:
    """Occupy the thread until the returned event is set (the calls after it queue)."""
    started, release = threading.Event(), threading.Event()

    def blocker() -> None:
        started.set()
        assert release.wait(10)

    threads.submit(0, blocker)
    assert started.wait(10)
    return release


def test_queued_calls_run_most_urgent_first_then_by_arrival(one_thread) -> None:
    release = hold(one_thread)
    order: list[str] = []
    calls = [(5, "low-a"), (0, "mid-a"), (-3, "high-a"), (5, "low-b"), (-3, "high-b"), (0, "mid-b")]
    futures = [one_thread.submit(p, order.append, name) for p, name in calls]
    assert order == []  # the running call is never interrupted
    release.set()
    for future in futures:
        future.result(10)
    assert order == ["high-a", "high-b", "mid-a", "mid-b", "low-a", "low-b"]


def test_an_error_reaches_its_caller_and_the_thread_serves_on(one_thread) -> None:
    def fail() -> None:
        raise ValueError("pool call failed")

    with pytest.raises(ValueError, match="pool call failed"):
        one_thread.submit(0, fail).result(10)
    assert one_thread.submit(0, lambda x: x + 1, 41).result(10) == 42


async def test_calls_take_keyword_arguments(one_thread) -> None:
    def call(*args: int, **kwargs: int) -> tuple[tuple[int, ...], dict[str, int]]:
        return args, kwargs

    # priority and fn are positional: a keyword of either name goes to the call
    assert one_thread.submit(0, call, 1, priority=2).result(10) == ((1,), {"priority": 2})
    assert await one_thread.run(0, call, 3, fn=4, wait_s=5) == ((3,), {"fn": 4, "wait_s": 5})


def test_a_call_cancelled_before_it_started_never_runs(one_thread) -> None:
    release = hold(one_thread)
    ran: list[str] = []
    dropped = one_thread.submit(0, ran.append, "dropped")
    kept = one_thread.submit(1, ran.append, "kept")
    assert dropped.cancel()
    release.set()
    kept.result(10)
    assert ran == ["kept"]


def test_run_awaits_on_the_event_loop_by_priority(one_thread) -> None:
    async def main() -> list[str]:
        release = hold(one_thread)
        order: list[str] = []
        low = asyncio.ensure_future(one_thread.run(10, order.append, "low"))
        high = asyncio.ensure_future(one_thread.run(-1, order.append, "high"))
        await asyncio.sleep(0)  # both submitted
        release.set()
        await asyncio.gather(low, high)
        return order

    assert asyncio.run(main()) == ["high", "low"]


def test_close_runs_what_is_queued_and_refuses_new_calls() -> None:
    threads = PriorityThreads(2, "test-close")
    release = hold(threads)
    ran: list[int] = []
    futures = [threads.submit(i, ran.append, i) for i in (3, 1, 2)]
    release.set()
    threads.close()
    assert all(f.done() for f in futures) and sorted(ran) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(0, ran.append, 4)
    with pytest.raises(ValueError, match="num_threads"):
        PriorityThreads(0, "none")
