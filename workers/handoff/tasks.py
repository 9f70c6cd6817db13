"""Waits that outlive a cancelled caller: the copies a worker thread runs read or write engine
KV blocks, so the caller must not go on (and free those blocks) before they end. No FastAPI
here: the GPU tests import the prefill writer without it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from workers.handoff.priority_threads import handoff_threads

T = TypeVar("T")


async def finish_in_thread(
    fn: Callable[..., T], /, *args: Any, priority: int = 0, **kwargs: Any
) -> T:
    """fn(*args, **kwargs) on a handoff thread (by priority: workers/handoff/priority_threads.py),
    awaited to its end even if the caller is cancelled.

    The thread copies bytes out of or into engine KV blocks. Returning early on cancellation
    would let the caller free those blocks, which another request may then get while the late
    copy still reads or writes them. fn bounds its own waits, so this wait is bounded too.
    """
    future = handoff_threads().submit(priority, fn, *args, **kwargs)
    return await wait_to_end(asyncio.wrap_future(future))


async def wait_to_end(task: asyncio.Future[T]) -> T:
    """task's result; a cancelled caller still waits for task to end, then is cancelled."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        raise
