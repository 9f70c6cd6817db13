"""The router's data-path client contract: one request API, one set of errors, two clients.

    orchestrator ──► Upstream.request(POST, url, body, headers, HopTimeout)
                         └─► UpstreamResponse: status_code, headers, read(), chunks()

Why not httpx alone: measured on the router benchmark (docs/benchmarks/router.md), httpx's own
transport (httpcore) cost about half of the router's CPU per streamed request (its pool
re-checks every idle connection with a poll and a getpeername call on every request), and
even over an aiohttp transport httpx's client layer (request and URL objects, cookie
extraction from every answer, redirect and auth plumbing) was a tenth of it. The data path
therefore does not use httpx's client. Its default is our own HTTP/1.1 client on asyncio
protocols and httptools (h1.py: half of aiohttp's time per call, measured there);
`--upstream-client aiohttp` remains (aiohttp_client.py), and carries https:// worker URLs.
Both raise exactly the same exception types, httpx's, which the failure policy
(pdrouter.router.orchestrator.failures) is written in:

    connection refused / unreachable           -> httpx.ConnectError     (instance unreachable)
    no connection within the connect bound     -> httpx.ConnectTimeout
    no bytes within the read bound             -> httpx.ReadTimeout      (slow, not dead)
    peer closed before or during the answer    -> httpx.RemoteProtocolError
    connection reset, other socket errors      -> httpx.ReadError
    the router's own pool full (h1)            -> httpx.PoolTimeout
    an answer head over the size bounds (h1)   -> httpx.RemoteProtocolError

A response whose body was read to its end returns its connection to the pool; one left
early (the client went away, a failover) is closed, which is how a worker learns that the
router gave up on the request: it aborts it then.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

# Idle connections are dropped before the workers' uvicorn does (its keep-alive is 30 s for
# our workers, 5 s by uvicorn's default): reusing one the worker is closing at that moment
# would fail a healthy worker's call.
KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class HopTimeout:
    """The bounds of one call: connect (also the wait for a pooled connection), the gap
    between two reads (the first included), and the request write (httpx only)."""

    connect_s: float
    read_s: float
    write_s: float = 10.0


class UpstreamResponse(Protocol):
    status_code: int
    headers: Mapping[str, str]  # case-insensitive

    @property
    def content(self) -> bytes:
        """The body; read() first."""

    @property
    def text(self) -> str:
        """The body as text (errors replaced); read() first."""

    async def read(self) -> bytes:
        """The whole body (errors mapped)."""

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as each network read brings it (errors mapped)."""

    @property
    def body_complete(self) -> bool:
        """Whether the whole body is in (read or not): reading the rest waits for nothing."""


class Upstream(Protocol):
    name: str

    def request(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> contextlib.AbstractAsyncContextManager[UpstreamResponse]:
        """The answer's status and headers once they arrive; the body is read inside."""

    async def aclose(self) -> None: ...


class BufferedAnswer:
    """What the implementations' responses share: the body they keep once read() ran, and
    its text."""

    _content: bytes | None = None

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("read() the response before using its content")
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")
