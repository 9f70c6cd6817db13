"""X-Request-Id on every router and worker response: the caller's id when it is sane, a new
one otherwise (the router passes its id along every hop, so a worker echoes the router's).

The id is resolved once, before any handler runs, and stored in the ASGI scope's state
(`request.state.request_id`), so the handler, the hops to P and D, the debug timeline, the
error handlers and this middleware all use the same one. Pure ASGI, not Starlette's
BaseHTTPMiddleware: that one buffers nothing but runs the app in another task, which breaks
the client-disconnect watch of streamed answers; this one only adds a header at
`http.response.start`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdrouter.wire.pd import REQUEST_ID_HEADER

# Ids travel in headers and log lines of every hop: keep them short and printable.
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_HEADER_LOWER = REQUEST_ID_HEADER.lower().encode()

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_id_of(scope: Scope) -> str:
    """The request id RequestIdMiddleware stored for this request."""
    return scope["state"]["request_id"]


def resolve_request_id(given: str | None) -> str:
    """given when it is a valid id, else a fresh random one."""
    if given and VALID_REQUEST_ID.match(given):
        return given
    # 128 random bits as 32 hex digits, as uuid4().hex (less 6 fixed bits) without the UUID.
    return os.urandom(16).hex()


class RequestIdMiddleware:
    """Sets scope state `request_id` and adds X-Request-Id to every response lacking it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == _HEADER_LOWER), b"")
        request_id = resolve_request_id(given.decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == _HEADER_LOWER for k, _ in headers):
                    headers.append((_HEADER_LOWER, encoded))
                    message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
