"""The router's HTTP transport to its workers: aiohttp's connection pool under the httpx API.

Why: measured on the router benchmark (docs/benchmarks/router.md), httpx's own transport
(httpcore) cost about half of the router's CPU per streamed request: its pool scans and
re-checks every idle connection (a poll and a getpeername system call each) on every
request, and its anyio layers add several more calls per read. aiohttp's client does the
same work for about half the CPU. The orchestrator keeps the httpx API and, above all, the
httpx exception types its failure policy is written in, so this transport maps aiohttp's
errors onto exactly those:

    connection refused / unreachable           -> httpx.ConnectError     (instance unreachable)
    no connection within the connect bound     -> httpx.ConnectTimeout
    no bytes within the read bound             -> httpx.ReadTimeout      (slow, not dead)
    peer closed before or during the answer    -> httpx.RemoteProtocolError
    connection reset, other socket errors      -> httpx.ReadError

Select it with `pdrouter serve --upstream-client aiohttp|httpx` (auto: aiohttp when
installed).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

UPSTREAM_CLIENTS = ("auto", "aiohttp", "httpx")


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError:
        raise RuntimeError(
            "--upstream-client aiohttp needs the aiohttp package: .venv/bin/pip install aiohttp "
            "(or choose --upstream-client httpx)"
        ) from None
    return aiohttp


def resolve_upstream_client(name: str) -> str:
    """'auto' -> 'aiohttp' when it can be imported, else 'httpx'; others as given."""
    if name not in UPSTREAM_CLIENTS:
        raise ValueError(f"upstream client {name!r} is not one of {UPSTREAM_CLIENTS}")
    if name != "auto":
        return name
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


@contextlib.contextmanager
def _mapped_errors(request: httpx.Request, connecting: bool) -> Iterator[None]:
    aiohttp = _aiohttp()
    try:
        yield
    except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        cls = (
            httpx.ConnectTimeout if connecting and not _is_read_timeout(exc) else httpx.ReadTimeout
        )
        raise cls(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientOSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(f"{type(exc).__name__}: {exc}", request=request) from exc


def _is_read_timeout(exc: BaseException) -> bool:
    socket_timeout = getattr(_aiohttp(), "SocketTimeoutError", None)
    return socket_timeout is not None and isinstance(exc, socket_timeout)


class _ResponseStream(httpx.AsyncByteStream):
    """The body as aiohttp delivers it (whatever each read brought), errors mapped."""

    def __init__(self, response: Any, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors(self._request, connecting=False):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        # Back to the pool when the body was read to its end; closed otherwise, which is how
        # a worker learns that the router gave up on the request (it aborts it then).
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx.AsyncBaseTransport over one aiohttp.ClientSession (created on first use, inside
    the router's event loop)."""

    # Idle connections are dropped before the workers' uvicorn does (its default keep-alive is
    # 5 s): reusing one the worker is closing at that moment would fail a healthy worker's call.
    def __init__(self, max_connections: int, keepalive_s: float = 4.0) -> None:
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            aiohttp = _aiohttp()
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, keepalive_timeout=self.keepalive_s
            )
            # No cookies, no automatic decompression: a relay passes bytes through.
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        aiohttp = _aiohttp()
        session = self._get_session()
        bounds = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=bounds.get("pool"),
            sock_connect=bounds.get("connect"),
            sock_read=bounds.get("read"),
        )
        body = await request.aread()
        with _mapped_errors(request, connecting=True):
            response = await session.request(
                request.method,
                str(request.url),
                headers=list(request.headers.multi_items()),
                data=body or None,
                allow_redirects=False,
                timeout=timeout,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_ResponseStream(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_upstream_transport(name: str, max_connections: int) -> httpx.AsyncBaseTransport | None:
    """The transport for `--upstream-client name`; None means httpx's default transport."""
    if resolve_upstream_client(name) == "aiohttp":
        return AiohttpTransport(max_connections)
    return None
