"""The handoff's threads: pool calls and copies served most urgent first.

Every handoff call of a worker blocks a thread on the pool or on a copy: P's pool prefix lookup
and load, P's writes (and the staging-slot waits inside them), D's reads. On a shared thread
pool they run in arrival order, so under a flood of less urgent requests an urgent request's
lookup or write queues behind every one of theirs. Here they wait in one queue ordered by the
request's priority (vLLM's: lower is more urgent), arrival order among equals:

    submit(priority, fn, *args, **kwargs)   queued; a free thread takes the most urgent first
    run(priority, fn, *args, **kwargs)      the same, awaited on the event loop (keyword
                                            arguments too, which run_in_executor does not take)

A call that started is never interrupted (it holds staging slots and engine blocks): an urgent
call waits at most for one running call per thread to end, never for the queue behind it.
handoff_threads() is the worker's one set (started on first use).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# As many as asyncio's default executor, which the handoff's calls ran on before (cores + 4, at
# most 32): they mostly wait on the pool's network and on copies, not on the CPU.
HANDOFF_THREADS = min(32, (os.cpu_count() or 1) + 4)


class PriorityThreads:
    """num_threads daemon threads (started with the first call) that run queued calls by
    priority, lower first, then by arrival."""

    def __init__(self, num_threads: int, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._num_threads, self._name = num_threads, name
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, concurrent.futures.Future[Any], Callable[[], Any]]] = []
        self._order = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(
        self, priority: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """fn(*args, **kwargs) on a thread once no more urgent call (or earlier equal one)
        waits."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} threads are closed")
            call = functools.partial(fn, *args, **kwargs)
            heapq.heappush(self._queue, (priority, next(self._order), future, call))
            if len(self._threads) < self._num_threads:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        return future

    @property
    def num_queued(self) -> int:
        """Calls waiting for a thread."""
        with self._cond:
            return len(self._queue)

    async def run(self, priority: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """submit(), awaited; cancelling the caller drops the call if it has not started."""
        return await asyncio.wrap_future(self.submit(priority, fn, *args, **kwargs))

    def close(self) -> None:
        """Run what is queued, then end the threads (waits for them)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                _, _, future, call = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue  # its caller left before it started
            try:
                result = call()
            except BaseException as exc:  # the caller gets it, the thread serves on
                future.set_exception(exc)
            else:
                future.set_result(result)


@functools.cache
def handoff_threads() -> PriorityThreads:
    """The worker's handoff threads (one set per process)."""
    return PriorityThreads(HANDOFF_THREADS, "kv-handoff")
