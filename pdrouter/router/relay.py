"""The client's SSE body, relayed from an answer's parts (RouterService.serve)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator

from pdrouter.router.asgi import Send
from pdrouter.router.disconnect_watch import DisconnectWatch
from pdrouter.wire.responses import SSE_DONE

logger = logging.getLogger(__name__)


async def relay_sse(
    first: bytes, parts: AsyncIterator[bytes], send: Send, watch: DisconnectWatch
) -> None:
    """The SSE body: each part of the answer (P's first token, first, then D's events a
    network read at a time) is one write; the part that ends with [DONE] also ends the body,
    and is the last one asked for (the rest, D's body read to its end, waits for finish_parts)."""
    part = first
    while not part.endswith(SSE_DONE):
        await send({"type": "http.response.body", "body": part, "more_body": True})
        next_part = await anext(parts, None)
        assert next_part is not None, "an answer's last part ends with [DONE]"
        part = next_part
    watch.finish()
    await send({"type": "http.response.body", "body": part, "more_body": False})


async def finish_parts(parts: AsyncGenerator[bytes], request_id: str, drain: bool) -> None:
    """A stream's parts after the request ended: drained (D's body read to its end, so that
    its connection goes back to the pool) after an answer, else closed (which closes D's
    connection: D aborts the request)."""
    try:
        if drain:
            await anext(parts, None)
    except Exception:
        logger.exception("request %s, after its end", request_id)
    finally:
        await parts.aclose()
