"""Who may call what: client API keys, the admin key, and the router-to-worker secret.

    client -> router   /v1/*            Authorization: Bearer <api key>     (--api-key)
    admin  -> router   /instances*      Authorization: Bearer <admin key>   (--admin-key)
    router -> worker   /internal/*      X-PD-Internal-Secret: <secret>      (--internal-secret)

Every comparison is constant-time (secrets.compare_digest), so a caller cannot learn a key a
byte at a time from response times. A key left unset means that door is open: the servers bind
127.0.0.1 unless told otherwise, and a deployment that listens elsewhere sets the keys.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import error_body

INTERNAL_SECRET_HEADER = "X-PD-Internal-Secret"
INTERNAL_PATH_PREFIX = "/internal/"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def secret_matches(given: str | None, expected: str | None) -> bool:
    """True when expected is unset, or given equals it (constant time)."""
    if expected is None:
        return True
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())


def bearer_matches(authorization: str | None, key: str | None) -> bool:
    """True when key is unset, or the Authorization header is exactly `Bearer <key>`."""
    if key is None:
        return True
    return secret_matches(authorization, f"Bearer {key}")


def require_bearer(authorization: str | None, key: str | None, what: str) -> None:
    """Raise a 401 APIError (OpenAI error shape) unless the header carries key.

    what names the key in the message ("API key", "admin key"), never its value.
    """
    if not bearer_matches(authorization, key):
        code = "invalid_api_key" if what == "API key" else "invalid_admin_key"
        raise APIError(
            401,
            f"invalid or missing {what} (send 'Authorization: Bearer <{what}>')",
            "invalid_request_error",
            code=code,
        )


def internal_headers(secret: str | None) -> dict[str, str]:
    """The headers the router sends on every hop to a worker."""
    return {INTERNAL_SECRET_HEADER: secret} if secret is not None else {}


class InternalSecretMiddleware:
    """Worker-side ASGI middleware: /internal/* answer 401 without the shared secret.

    Pure ASGI (no BaseHTTPMiddleware) so that it adds nothing to a streamed decode response:
    a request that passes is handed to the app untouched.
    """

    def __init__(self, app: ASGIApp, secret: str) -> None:
        if not secret:
            raise ValueError("InternalSecretMiddleware needs a non-empty secret")
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(INTERNAL_PATH_PREFIX):
            wanted = INTERNAL_SECRET_HEADER.lower().encode()
            given = next((v for k, v in scope["headers"] if k == wanted), None)
            if given is None or not secrets.compare_digest(given, self.secret.encode()):
                await _send_401(send, scope["path"])
                return
        await self.app(scope, receive, send)


async def _send_401(send: Send, path: str) -> None:
    message = f"{path} needs the router's shared secret in the {INTERNAL_SECRET_HEADER} header"
    body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_secret"))
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})
