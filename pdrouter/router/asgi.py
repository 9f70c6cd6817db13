"""Plain-ASGI pieces of the router's OpenAI path: body reading, JSON and SSE answers.

The two OpenAI POST routes carry every token the router relays, so they are served by plain
ASGI code (app.RouterApp, service.RouterService) instead of FastAPI's routing, middleware stack and
StreamingResponse: on the router benchmark those layers cost more CPU per request than the
whole PD flow (docs/benchmarks/router.md). What they did for these routes is done here:
bounded body reading, JSON and SSE answers; noticing a client that goes away is
disconnect_watch.DisconnectWatch.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdrouter.wire.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_START_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    # Proxies must pass each event on at once rather than buffer the stream.
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (name in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Receive, limit_bytes: int) -> bytes:
    """The whole request body; 413 as soon as it is longer than limit_bytes, and 499 if the
    client leaves before sending all of it."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(499, "client disconnected", "invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise APIError(
                413,
                f"request body is larger than {limit_bytes} bytes (the router's --max-body-bytes)",
                "invalid_request_error",
                code="request_too_large",
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def run_lifespan(
    receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]] | None = None
) -> None:
    """The ASGI lifespan of an app with nothing to start: startup is acknowledged at once,
    on_shutdown (if any) runs before shutdown is."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if on_shutdown is not None:
                await on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


def json_bytes(payload: Any) -> bytes:
    """Compact UTF-8 JSON, as Starlette's JSONResponse writes it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8"
    )


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """A whole JSON answer (body already encoded)."""
    start_headers = [
        *JSON_HEADERS,
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
