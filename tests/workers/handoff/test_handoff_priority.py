"""The handoff's pool work by priority, through the calls the workers make: P's ChunkedWrite
parts and D's reads (finish_in_thread) queue on the handoff threads by the request's priority,
so an urgent request's puts run before the queued ones of a less urgent request that came
first. One handoff thread, held busy while both queue, makes the order exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.wait import async_wait_until
from tests.workers.handoff.fake_pool import FakePool, kv_views
from workers.handoff import pool_prefix, tasks, writer
from workers.handoff.priority_threads import PriorityThreads
from workers.handoff.tasks import finish_in_thread
from workers.handoff.writer import ChunkedWrite

BS = 4


@pytest.fixture
def threads(monkeypatch) -> Iterator[PriorityThreads]:
    one = PriorityThreads(1, "test-handoff")
    for module in (writer, tasks, pool_prefix):
        monkeypatch.setattr(module, "handoff_threads", lambda: one)
    yield one
    one.close()


def hold(threads: PriorityThreads) -> threading.Event:
    started, release = threading.Event(), threading.Event()
    threads.submit(-(2**31), lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return release


async def test_an_urgent_request_s_writes_go_before_queued_less_urgent_ones(threads) -> None:
    pool = FakePool(BS)
    puts: list[str] = []
    pool.on_put = puts.extend
    caches = kv_views(np.arange(8 * BS, dtype=np.int64).reshape(8, BS))
    release = hold(threads)
    low = ChunkedWrite(pool, caches, ["low-0", "low-1"], group_blocks=1, wait_s=5.0, priority=5)
    high = ChunkedWrite(pool, caches, ["high-0", "high-1"], group_blocks=1, wait_s=5.0,
                        priority=-1)  # fmt: skip
    low.add(0, [0, 1])  # arrived first
    high.add(0, [2, 3])
    await async_wait_until(lambda: threads.num_queued == 2, 10, "both writes queued")
    release.set()
    low_out, high_out = await low.finish(), await high.finish()
    assert (low_out.num_written, high_out.num_written) == (2, 2)
    assert puts == ["high-0", "high-1", "low-0", "low-1"]
    assert pool.slots.num_free == 16


async def test_reads_finish_in_thread_by_priority(threads) -> None:
    order: list[str] = []
    release = hold(threads)
    low = asyncio.ensure_future(finish_in_thread(order.append, "low", priority=3))
    default = asyncio.ensure_future(finish_in_thread(order.append, "default"))
    high = asyncio.ensure_future(finish_in_thread(order.append, "high", priority=-2))
    await async_wait_until(lambda: threads.num_queued == 3, 10, "the three reads queued")
    release.set()
    await asyncio.gather(low, default, high)
    assert order == ["high", "default", "low"]
