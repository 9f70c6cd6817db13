"""One in-flight bound for the whole worker: client and internal calls counted together.

    POST /v1/chat/completions, /v1/completions,    ─┐  counted from arrival to the
         /v1/responses                              │
    POST /internal/prefill, /internal/decode        ─┴─ last byte of the answer
                                                       (a decode stream: its whole life)
    count == --max-pending-requests  ─► 503 service_unavailable, Retry-After, code "overloaded"

The router registers this bound as the worker's capacity and sends no more calls than it
(pdrouter.router.selection.admission), so the 503 here is what a router that does not know
the bound, a second router sharing the worker, or a direct client meets. Pure ASGI, outside the
body limit: a refused request's body is never read. Everything else (health, metrics, admin)
passes uncounted, so an overloaded worker still answers its health checks.
"""

from __future__ import annotations

import json
from typing import Any

from pdrouter.wire.errors import unavailable

BOUNDED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/internal/prefill",
        "/internal/decode",
    }
)


class InFlightLimitMiddleware:
    """Refuses a bounded call while max_in_flight others are still being answered."""

    def __init__(self, app: Any, max_in_flight: int, retry_after_s: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.app = app
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.num_refused = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in BOUNDED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if self.num_in_flight >= self.max_in_flight:
            self.num_refused += 1
            await self._refuse(send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    async def _refuse(self, send: Any) -> None:
        exc = unavailable(
            f"server is full ({self.num_in_flight} requests in flight, "
            f"--max-pending-requests {self.max_in_flight}); retry later",
            "overloaded",
            self.retry_after_s,
        )
        payload = json.dumps(exc.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
