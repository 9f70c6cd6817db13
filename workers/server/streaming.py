"""A StreamingResponse that always closes its body iterator, so an early exit aborts the request.

When the client disconnects, Starlette cancels the task that iterates the body. If the body
generator was suspended at a `yield` at that moment, it is not closed, only dropped, and its
`finally` (which aborts the engine request and frees its KV blocks) would run whenever the
garbage collector gets to it. Closing it here makes that immediate; `on_close` covers a
generator that never started (then its own `finally` never runs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """SSE response whose iterator is closed and on_close called however the response ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: Mapping[str, str] | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(content, headers=headers, media_type=media_type)
        self._content = content
        self._on_close = on_close

    def also_on_close(self, callback: Callable[[], None]) -> None:
        """Call callback too, after on_close, when the response ends."""
        first = self._on_close

        def both() -> None:
            first()
            callback()

        self._on_close = both

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                # Shielded: when the whole task is being cancelled (server shutdown) the close,
                # which aborts the engine request, must still run to the end.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(aclose())
            self._on_close()
