"""Plain-ASGI pieces of the router's OpenAI path: body reading, JSON and SSE answers.

The two OpenAI POST routes carry every token the router relays, so they are served by plain
ASGI code (app.RouterApp, service.RouterService) instead of FastAPI's routing, middleware stack and
StreamingResponse: on the router benchmark those layers cost more CPU per request than the
whole PD flow (docs/benchmarks/router.md). What they did for these routes is done here:
JSON and SSE answers; the bounded body read is pdrouter.common.body_limit.read_body, noticing a
client that goes away is disconnect_watch.DisconnectWatch.
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


async def send_api_error(
    send: Send, error: APIError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An APIError as a whole JSON answer: its status, its OpenAI error body, its headers
    (Retry-After, Allow, WWW-Authenticate) and headers after them."""
    error_headers = [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send_json(
        send, error.status, json_bytes(error.body()), [*error_headers, *(headers or [])]
    )
