"""Plain-ASGI pieces of the router's OpenAI path: body reading, answers, disconnect watch.

The two OpenAI POST routes carry every token the router relays, so they are served by plain
ASGI code (router_app.RouterApp) instead of FastAPI's routing, middleware stack and
StreamingResponse: on the router benchmark those layers cost more CPU per request than the
whole PD flow (docs/benchmarks/router.md). What they did for these routes is done here:
bounded body reading, JSON and SSE answers, and noticing a client that goes away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdrouter.wire.errors import RouterError

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
            raise RouterError(499, "client disconnected", "invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise RouterError(
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


class DisconnectWatch:
    """Cancels the task serving a request when its client goes away before the answer ends.

    One task per request waits for uvicorn's `http.disconnect` (which it also delivers once
    the answer is complete: `finish()` first tells the two apart). Cancelling the serving
    task closes whatever it awaits at that moment, P's call or D's stream, and closing a
    worker's connection is how the worker learns to abort the request and free its blocks.
    Without this a streamed request whose D is slow would notice the client only at its next
    write, and a request still in prefill not at all.

    The watching task is never cancelled: it ends at the `http.disconnect` that the server
    delivers once the answer is complete (the ASGI spec's receive after a response), or when
    the connection closes. A cancelled task keeps its CancelledError, whose traceback holds
    the task's frames and so the task: a reference cycle that only the garbage collector
    frees. One per request made the router's collections about ten times as frequent (every
    15 requests instead of every 200, with a 30 ms full collection every few thousand).
    """

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._finished = False
        task = asyncio.current_task()
        assert task is not None, "DisconnectWatch runs inside a task"
        self.served = task  # the task serving the request
        # Started when the served task first waits (on P, as a rule: the router has nothing
        # else to do then), not before the request goes to P. A client gone meanwhile is
        # noticed by the watch's first receive.
        self._watch: asyncio.Task[None] | None = None  # held: asyncio keeps tasks weakly
        task.get_loop().call_soon(self._start, receive)

    def _start(self, receive: Receive) -> None:
        if not self._finished:
            self._watch = asyncio.ensure_future(self._run(receive))

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._finished:
            self.gone = True
            self.served.cancel()

    def finish(self) -> None:
        """The answer is (about to be) complete: a disconnect from now on is not a leave."""
        self._finished = True

    def absorb(self) -> bool:
        """After a CancelledError in the served task: True (and the cancel request taken
        back) when it was this watch's doing, False when someone else cancelled the task."""
        if self.gone and self.served.cancelling():
            self.served.uncancel()
            return True
        return False

    def stop(self) -> None:
        """The request is over (its answer complete, or the client gone): whatever the
        watching task receives from now on is not a leave, and it ends by itself."""
        self._finished = True
