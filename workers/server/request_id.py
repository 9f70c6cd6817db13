"""X-Request-Id: accept the caller's (the router passes one id along every hop) or make one.

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which buffers streaming
responses and hides client disconnects from the endpoint.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
# Ids end up in engine keys, logs and response ids: keep them short and printable.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_of(scope: Scope) -> str:
    """The request id the middleware stored for this request."""
    return scope["state"]["request_id"]


class RequestIdMiddleware:
    """Stores the request id in scope['state'] and echoes it in the response headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = ""
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER.encode():
                given = value.decode("latin-1").strip()
                break
        request_id = given if _VALID_ID.match(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
