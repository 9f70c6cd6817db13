"""The outputs of one engine request as an async iterator, fed by the engine thread.

engine thread:  loop.call_soon_threadsafe(stream.queue.put_nowait, output | error)
event loop:     async for out in RequestStream: ...   (closing it early aborts)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.api import RequestOutput


@dataclass
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """The outputs of one request, an async iterator; see AsyncEngine.generate().

    forget(request_id, stream, abort) is called once when it is done: the engine stops
    delivering to it, and aborts the request if asked."""

    def __init__(
        self,
        forget: Callable[[str, Stream, bool], None],
        request_id: str,
        stream: Stream,
        timeout_s: float,
    ) -> None:
        self.request_id = request_id
        self._forget = forget
        self._stream = stream
        self._timeout_s = timeout_s
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns a result that is already there
            # instead of raising a cancellation that arrived at the same time, and outputs are
            # nearly always there, so a cancelled consumer would keep its request alive.
            async with asyncio.timeout(self._timeout_s):
                item = await self._stream.queue.get()
        except TimeoutError:
            self._close(abort=True)
            raise TimeoutError(
                f"request {self.request_id!r}: no output from the engine for {self._timeout_s} s"
            ) from None
        except BaseException:  # cancelled: the consumer is gone
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close(abort=False)  # the engine has already dropped the request
            raise item
        if item.ends_stream:  # a group's stream ends with its last sequence
            self._close(abort=False)
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request unless its final output was delivered."""
        self._close(abort=True)

    def __del__(self) -> None:
        # A consumer that breaks out of `async for` without aclose(): abort when collected.
        # abort() only posts a command, so this is safe from any thread.
        if not self._done:
            self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._forget(self.request_id, self._stream, abort)
