"""The suite's one way to wait for a state: poll a probe until it holds, within a bound.

    m = wait_until(lambda: metrics_of(url), timeout_s=20, what="worker idle",
                   done=lambda m: m["pdworker_kv_blocks_used"] == 0)

A probe returns a value; the wait ends when `done(value)` is true (by default: the value is
truthy) and returns that value. Past the bound it fails the test with an AssertionError naming
what was awaited and the last value seen, never by returning a stale value for the caller to
re-check. Probes that raise the exception types in `retry_on` (a server not up yet) count as
"not yet". Tests never sleep a fixed time to let a state come about: they wait for it here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_UNSEEN = object()


def _timed_out(what: str, timeout_s: float, last: Any, error: BaseException | None) -> str:
    seen = "nothing (the probe never answered)" if last is _UNSEEN else repr(last)
    if isinstance(seen, str) and len(seen) > 2000:
        seen = seen[:2000] + "..."
    cause = f"; last probe error: {error!r}" if error is not None else ""
    return f"timed out after {timeout_s:g} s waiting for {what}; last value: {seen}{cause}"


def wait_until(
    probe: Callable[[], T],
    timeout_s: float,
    what: str,
    done: Callable[[T], bool] = bool,
    interval_s: float = 0.02,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call probe every interval_s until done(its value); return that value."""
    deadline = time.monotonic() + timeout_s
    last: Any = _UNSEEN
    error: BaseException | None = None
    while True:
        try:
            last = probe()
            error = None
            if done(last):
                return last
        except retry_on as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s, last, error))
        time.sleep(interval_s)


async def async_wait_until(
    probe: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    done: Callable[[T], bool] = bool,
    interval_s: float = 0.01,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """wait_until for a running event loop: the probe may be a plain or an async function."""
    deadline = time.monotonic() + timeout_s
    last: Any = _UNSEEN
    error: BaseException | None = None
    while True:
        try:
            value = probe()
            last = await value if asyncio.iscoroutine(value) else value
            error = None
            if done(last):
                return last
        except retry_on as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s, last, error))
        await asyncio.sleep(interval_s)
