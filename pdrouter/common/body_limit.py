"""How large a request body may be: bounded by the context length the prompt must fit in.

    limit_bytes = max_model_len * max_bytes_per_token + ENVELOPE_BYTES

A token is a few bytes of text (the byte-level tokenizers of the Llama family: about 4 on
English, at most a few dozen on odd input); max_bytes_per_token is a generous upper bound on
that, so a body over the limit cannot hold a prompt that fits the context, and is refused with
400 `context_length_exceeded` before anything tokenizes it (unbounded, a 10 MB prompt kept a
prefill worker's event loop busy for 12 s). ENVELOPE_BYTES leaves room for everything else in
the body (sampling fields, stop strings, the JSON itself). The router uses
ROUTER_BYTES_PER_TOKEN over the largest max_model_len its instances report; a worker uses
WORKER_BYTES_PER_TOKEN (its internal P/D messages also carry the prompt's token ids) over its
own. An explicit byte limit (--max-body-bytes) replaces the derived one and answers 413. Until
a context length is known (no instance checked yet, a worker still loading) FALLBACK_BODY_BYTES
holds.

read_body         the router's plain-ASGI routes: read the body within a limit
BodyLimitMiddleware  every other route of the router and the workers: every body read within
                  the limit before the app sees it (a path may have a fixed bound of its own:
                  the router's admin API, ADMIN_BODY_LIMIT)

The bodies being read at one time are bounded too, over the whole process (PendingBodies,
PENDING_BODY_MAX_BYTES): a body whose next part would pass it is refused with 503 and
Retry-After. Each body is bounded by the limit and in time by the body deadline
(pdrouter.common.body_deadline), but without this bound many clients sending large bodies
slowly held them all at once: 1,000 connections x 190 KB took the router from 88 to 262 MB.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pdrouter.wire.errors import APIError

ENVELOPE_BYTES = 64 * 1024
ROUTER_BYTES_PER_TOKEN = 64
WORKER_BYTES_PER_TOKEN = 80
FALLBACK_BODY_BYTES = 32 * 1024 * 1024
# A refused body is still read (and dropped) up to this many bytes before the answer, so that
# the client, which may not read before it has sent everything, sees the answer instead of a
# connection reset; past it the connection is closed.
DRAIN_MAX_BYTES = 64 * 1024 * 1024

# The most bytes of bodies not yet whole that one process holds at once: far above what
# clients sending at network speed keep in flight (a few hundred 100 KB prompts).
PENDING_BODY_MAX_BYTES = 128 * 1024 * 1024

# The statuses this module answers (for the apps' lists of error statuses).
STATUS_CONTEXT_EXCEEDED = 400
STATUS_TOO_LARGE = 413
STATUS_BODIES_FULL = 503

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class BodyLimit:
    """A byte bound on request bodies and how a body over it is refused."""

    limit_bytes: int
    # The context length it was derived from; None: an explicit byte limit (413).
    max_model_len: int | None
    bytes_per_token: int
    flag: str  # the flag that changes it, named in the refusal

    def refusal(self, num_bytes: int) -> APIError:
        if self.max_model_len is None:
            return APIError(
                STATUS_TOO_LARGE,
                f"request body is larger than {self.limit_bytes} bytes ({self.flag})",
                "invalid_request_error",
                code="request_too_large",
            )
        return APIError(
            STATUS_CONTEXT_EXCEEDED,
            f"This model's maximum context length is {self.max_model_len} tokens, and the "
            f"request body has at least {num_bytes} bytes: more than a prompt that fits can "
            f"take ({self.limit_bytes} bytes at {self.bytes_per_token} bytes per token, "
            f"{self.flag})",
            "invalid_request_error",
            code="context_length_exceeded",
        )


# The router's admin API (an instance's registration, a drain): small JSON, never a prompt.
ADMIN_BODY_LIMIT = BodyLimit(ENVELOPE_BYTES, None, ROUTER_BYTES_PER_TOKEN, "the admin API's bound")


class PendingBodies:
    """The bytes of the request bodies being read (not yet whole), over the process."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def take(self, num_bytes: int) -> None:
        """Count num_bytes more as held; 503 when that would pass max_bytes."""
        if self.held_bytes + num_bytes > self.max_bytes:
            raise APIError(
                STATUS_BODIES_FULL,
                f"the server holds {self.max_bytes} bytes of request bodies still arriving; "
                "retry later",
                "service_unavailable",
                code="too_many_pending_bodies",
                retry_after_s=1,
            )
        self.held_bytes += num_bytes

    def give_back(self, num_bytes: int) -> None:
        self.held_bytes -= num_bytes


PENDING = PendingBodies(PENDING_BODY_MAX_BYTES)


def body_limit(
    explicit_bytes: int | None, max_model_len: int | None, bytes_per_token: int, flag: str
) -> BodyLimit:
    """The explicit limit when given, else the one derived from max_model_len (the fallback
    while that is unknown)."""
    if explicit_bytes is not None:
        return BodyLimit(explicit_bytes, None, bytes_per_token, flag)
    if max_model_len is None:
        return BodyLimit(FALLBACK_BODY_BYTES, None, bytes_per_token, flag)
    limit_bytes = max_model_len * bytes_per_token + ENVELOPE_BYTES
    return BodyLimit(limit_bytes, max_model_len, bytes_per_token, flag)


def declared_length(scope: Message) -> int | None:
    """The request's Content-Length, None when absent or not a number."""
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(
    receive: Receive,
    limit: BodyLimit,
    declared_bytes: int | None = None,
    pending: PendingBodies = PENDING,
) -> bytes:
    """The whole request body; refused (limit.refusal) once it is, or says it will be, longer
    than the limit (the rest is drained first, see DRAIN_MAX_BYTES), 503 when the bodies
    still arriving would pass pending's bound, and 499 if the client leaves before sending
    all of it. Nothing over the limit is ever kept."""
    if declared_bytes is not None and declared_bytes > limit.limit_bytes:
        if declared_bytes <= DRAIN_MAX_BYTES:
            await _drain(receive, 0)
        raise limit.refusal(declared_bytes)
    parts: list[bytes] = []
    size = 0
    held = 0  # of pending: the parts kept while more is to come
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(499, "client disconnected", "invalid_request_error")
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > limit.limit_bytes:
                parts.clear()
                if more:
                    size = await _drain(receive, size)
                raise limit.refusal(size)
            if not more:
                parts.append(chunk)
                return parts[0] if len(parts) == 1 else b"".join(parts)
            pending.take(len(chunk))
            held += len(chunk)
            parts.append(chunk)
    finally:
        pending.give_back(held)


async def _drain(receive: Receive, size: int) -> int:
    """Read and drop the rest of a body (up to DRAIN_MAX_BYTES in all); the bytes seen."""
    while size <= DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(499, "client disconnected", "invalid_request_error")
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return size


class BodyLimitMiddleware:
    """Pure ASGI: a request body over limit() is refused before the app runs (the body is
    read here, then handed to the app whole); everything else passes untouched."""

    def __init__(
        self,
        app: Any,
        limit: Callable[[], BodyLimit],
        path_limits: tuple[tuple[str, BodyLimit], ...] = (),
    ) -> None:
        self.app = app
        self.limit = limit
        self.path_limits = path_limits  # (path prefix, its bound): the first match wins

    def limit_of(self, path: str) -> BodyLimit:
        for prefix, limit in self.path_limits:
            if path.startswith(prefix):
                return limit
        return self.limit()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            limit = self.limit_of(scope["path"])
            body = await read_body(receive, limit, declared_length(scope))
        except APIError as exc:
            if exc.status == 499:
                return
            payload = json.dumps(exc.body()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ]
            headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        await self.app(scope, replaying(body, receive), send)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that gives body, whole, first, then whatever receive gives (the disconnect):
    for an app behind a reader that took the body off the wire already."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
