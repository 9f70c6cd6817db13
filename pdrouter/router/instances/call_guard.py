"""Calls in flight to an instance, given up when its health checks find it down.

    request ─► CallGuard(inst) ─► P's answer / D's stream
                   ▲
    health loop ───┘ inst down (N failed checks in a row), no call on it has had anything
                     for --abandon-after-s, and this call silent that long too: give it up

A worker that freezes (a stuck GPU, SIGSTOP, a wedged event loop) neither answers nor closes
its connections, so its calls would wait for their read bounds: the whole prefill bound on P,
the gap between two events on D (300 s by default). Two signals together say it froze: its
health checks fail, and a call on it has had nothing from it for --abandon-after-s (10 s by
default). Either alone is not enough: a worker busy under load can miss health checks while
it streams on (giving its streams up then would fail them for nothing, the more so when no
other instance is left), and a call can be silent for long on a live worker (a long prefill,
or a request queued behind others in the engine). So silence is judged per instance as well
as per call: an instance any of whose calls got something (a stream's bytes, an answer's
head or body) within --abandon-after-s is making progress, and none of its calls is given
up, however long one of them has waited (CallSet.last_progress_s).
Such a call fails at once with InstanceDown, an httpx.TransportError, and the orchestrator
treats it as any transport failure: the prefill is retried on another P, the stream resumes
on another D from the tokens already sent.

Mechanics: a guarded call marks the moments its task awaits the worker (the answer's head,
each read of its body). Abandoning a call whose task is waiting there cancels the task, and
the guard turns that cancellation into InstanceDown; a call abandoned while its task is busy
elsewhere (writing the last tokens to the client, say) fails at its next read instead. A
client disconnect that cancels the same task wins: its cancellation is never swallowed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

import httpx

T = TypeVar("T")


class InstanceDown(httpx.TransportError):
    """The call was given up: health checks found its instance down, and it was silent."""


class CallSet(set["CallGuard"]):
    """An instance's calls in flight, and when any of them last got something from it (the
    instance's progress: a busy instance streams on while it misses health checks)."""

    __slots__ = ("last_progress_s",)

    def __init__(self) -> None:
        super().__init__()
        self.last_progress_s: float | None = None  # None: no call has had anything yet

    def progressing(self, now_s: float, window_s: float) -> bool:
        """Whether some call got something from the instance within window_s of now_s."""
        return self.last_progress_s is not None and now_s - self.last_progress_s < window_s


class CallGuard:
    """One call to the instance at url, registered in `calls` (that instance's) while the
    with-block runs; abandon() gives it up."""

    __slots__ = ("_calls", "_cancel_sent", "last_active_s", "reason", "task", "url", "waiting")

    def __init__(
        self, calls: set[CallGuard], url: str, task: asyncio.Task[Any] | None = None
    ) -> None:
        """task: the one making the call (None: the current task)."""
        self._calls = calls
        self.url = url
        if task is None:
            task = asyncio.current_task()
        assert task is not None, "a CallGuard runs inside a task"
        self.task = task
        self.waiting = False
        self.reason: str | None = None
        self._cancel_sent = False  # whether abandon() cancelled the task (once at most)
        self.last_active_s = time.monotonic()  # the call's start, then its last read

    def __enter__(self) -> CallGuard:
        self._calls.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._calls.discard(self)

    def abandon(self, reason: str) -> None:
        """Give the call up: at once if its task waits on the worker, else at its next read."""
        if self.reason is not None:
            return
        self.reason = reason
        if self.waiting:
            self._cancel_sent = True
            self.task.cancel()

    def _down(self) -> InstanceDown:
        return InstanceDown(f"{self.url} found down by health checks ({self.reason})")

    def _raise_if_abandoned(self, pending: object = None) -> None:
        """InstanceDown at once if the call was given up (pending: the awaitable it will not
        await, closed so that it does not warn of never being awaited)."""
        if self.reason is not None:
            if inspect.iscoroutine(pending):
                pending.close()
            raise self._down()

    def _reraise(self, cancelled: asyncio.CancelledError) -> NoReturn:
        """For an except CancelledError: InstanceDown if the cancellation was only ours; the
        cancellation itself if it was someone else's too (the client left): it stands."""
        if self._cancel_sent:
            self._cancel_sent = False
            if self.task.uncancel() == 0:
                raise self._down() from None
        raise cancelled

    async def call(self, awaitable: Awaitable[T]) -> T:
        """await awaitable, given up if the instance goes down meanwhile."""
        self._raise_if_abandoned(awaitable)
        self.waiting = True
        try:
            result = await awaitable
        except asyncio.CancelledError as cancelled:
            self._reraise(cancelled)
        finally:
            self.waiting = False
            self.last_active_s = time.monotonic()
        if isinstance(self._calls, CallSet):  # the worker gave something: it progresses
            self._calls.last_progress_s = self.last_active_s
        return result

    def entered(self, cm: Any) -> GuardedCall:
        """An async context manager (an upstream request) whose entering is guarded."""
        return GuardedCall(self, cm)


class GuardedCall:
    """An upstream request (an async context manager) whose entering, the wait for the
    answer's head, goes through its call's guard."""

    __slots__ = ("_cm", "_guard")

    def __init__(self, guard: CallGuard, cm: Any) -> None:
        self._guard = guard
        self._cm = cm

    async def __aenter__(self) -> Any:
        return await self._guard.call(self._cm.__aenter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._cm.__aexit__(*exc)


def abandon_stalled(calls: set[CallGuard], reason: str, silent_for_s: float) -> int:
    """Abandon the calls that have had nothing from their worker for silent_for_s (since
    they started, or since their last read), unless some call of the same instance got
    something within silent_for_s (CallSet: the instance progresses, so a silent call is
    queued behind the others, not hung); returns how many."""
    now = time.monotonic()
    if isinstance(calls, CallSet) and calls.progressing(now, silent_for_s):
        return 0
    stalled = [g for g in calls if g.reason is None and now - g.last_active_s >= silent_for_s]
    for guard in stalled:
        guard.abandon(reason)
    return len(stalled)
