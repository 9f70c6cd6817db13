"""The router's data-path client to its workers: one request API over three clients.

    orchestrator ──► Upstream.request(POST, url, body, headers, HopTimeout)
                         └─► UpstreamResponse: status_code, headers, read(), chunks()

Why not httpx alone: measured on the router benchmark (docs/benchmarks/router.md), httpx's own
transport (httpcore) cost about half of the router's CPU per streamed request (its pool
re-checks every idle connection with a poll and a getpeername call on every request), and
even over an aiohttp transport httpx's client layer (request and URL objects, cookie
extraction from every answer, redirect and auth plumbing) was a tenth of it. The data path
therefore does not use httpx. Its default is our own HTTP/1.1 client on asyncio protocols
and httptools (pdrouter.router.upstream.h1: half of aiohttp's time per call, measured there);
`--upstream-client aiohttp` and `--upstream-client httpx` remain. All three raise exactly the
same exception types, httpx's, which the failure policy (orchestrator.py) is written in:

    connection refused / unreachable           -> httpx.ConnectError     (instance unreachable)
    no connection within the connect bound     -> httpx.ConnectTimeout
    no bytes within the read bound             -> httpx.ReadTimeout      (slow, not dead)
    peer closed before or during the answer    -> httpx.RemoteProtocolError
    connection reset, other socket errors      -> httpx.ReadError
    the router's own pool full (h1, httpx)     -> httpx.PoolTimeout

A response whose body was read to its end returns its connection to the pool; one left
early (the client went away, a failover) is closed, which is how a worker learns that the
router gave up on the request: it aborts it then.

aiohttp has no write timeout; the request bodies are small JSON documents written to a
socket that accepted them, so the connect and read bounds bound the whole call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

UPSTREAM_CLIENTS = ("auto", "h1", "aiohttp", "httpx")

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
    """'auto' -> 'h1' (httptools is a dependency of pdrouter), else the name as given."""
    if name not in UPSTREAM_CLIENTS:
        raise ValueError(f"upstream client {name!r} is not one of {UPSTREAM_CLIENTS}")
    return "h1" if name == "auto" else name


def make_upstream(name: str, max_connections: int, headers: Mapping[str, str]) -> Upstream:
    """The data-path client for `--upstream-client name`; headers go with every call."""
    chosen = resolve_upstream_client(name)
    if chosen == "h1":
        from pdrouter.router.upstream.h1 import H1Upstream

        return H1Upstream(max_connections, headers)
    if chosen == "aiohttp":
        return AiohttpUpstream(max_connections, headers)
    return HttpxUpstream(max_connections, headers)


# -- aiohttp ------------------------------------------------------------------------------


def _is_read_timeout(aiohttp: Any, exc: BaseException) -> bool:
    socket_timeout = getattr(aiohttp, "SocketTimeoutError", None)
    return socket_timeout is not None and isinstance(exc, socket_timeout)


@contextlib.contextmanager
def _mapped_errors(aiohttp: Any, connecting: bool) -> Iterator[None]:
    try:
        yield
    except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS
        raise httpx.ConnectError(str(exc)) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        read = not connecting or _is_read_timeout(aiohttp, exc)
        cls = httpx.ReadTimeout if read else httpx.ConnectTimeout
        raise cls(str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientOSError as exc:
        raise httpx.ReadError(str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(f"{type(exc).__name__}: {exc}") from exc


class _Answer:
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


# Built once per distinct value, not per call: instance URLs x paths and hop bounds are few.
@functools.lru_cache(maxsize=4096)
def _parsed_url(url: str) -> Any:
    import yarl

    return yarl.URL(url)


@functools.lru_cache(maxsize=64)
def _client_timeout(t: HopTimeout) -> Any:
    return _aiohttp().ClientTimeout(
        total=None, connect=t.connect_s, sock_connect=t.connect_s, sock_read=t.read_s
    )


class _AiohttpResponse(_Answer):
    def __init__(self, aiohttp: Any, response: Any) -> None:
        self._aiohttp = aiohttp
        self._response = response
        self.status_code: int = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        if self._content is None:
            with _mapped_errors(self._aiohttp, connecting=False):
                self._content = await self._response.read()
        return self._content

    async def chunks(self) -> AsyncIterator[bytes]:
        with _mapped_errors(self._aiohttp, connecting=False):
            async for chunk in self._response.content.iter_any():
                yield chunk


class AiohttpUpstream:
    """aiohttp's connection pool, one ClientSession created on first use (inside the
    router's event loop): no cookies, no decompression (a relay passes bytes through)."""

    name = "aiohttp"

    def __init__(self, max_connections: int, headers: Mapping[str, str]) -> None:
        self.max_connections = max_connections
        self.headers = dict(headers)
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            aiohttp = _aiohttp()
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, keepalive_timeout=KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self.headers,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            )
        return self._session

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> AsyncIterator[UpstreamResponse]:
        aiohttp = _aiohttp()
        session = self._get_session()
        with _mapped_errors(aiohttp, connecting=True):
            response = await session.request(
                method,
                _parsed_url(url),
                data=content,
                headers=headers,
                allow_redirects=False,
                timeout=_client_timeout(timeout),
            )
        try:
            yield _AiohttpResponse(aiohttp, response)
        finally:
            # Back to the pool when the body was read to its end; closed otherwise.
            response.release()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# -- httpx --------------------------------------------------------------------------------


class _HttpxResponse(_Answer):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers

    @property
    def content(self) -> bytes:
        return self._response.content

    async def read(self) -> bytes:
        return await self._response.aread()

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            yield chunk


class HttpxUpstream:
    """httpx's own client and transport (httpcore)."""

    name = "httpx"

    def __init__(self, max_connections: int, headers: Mapping[str, str]) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=128)
        self._client = httpx.AsyncClient(
            limits=limits, headers=dict(headers), timeout=httpx.Timeout(10.0)
        )

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> AsyncIterator[UpstreamResponse]:
        bounds = httpx.Timeout(
            connect=timeout.connect_s,
            read=timeout.read_s,
            write=timeout.write_s,
            pool=timeout.connect_s,
        )
        async with self._client.stream(
            method, url, content=content, headers=headers, timeout=bounds
        ) as response:
            yield _HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()
