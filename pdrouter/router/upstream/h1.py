"""The router's own HTTP/1.1 client to its workers: asyncio protocols and httptools' parser.

    H1Upstream.request(POST, url, body, headers, HopTimeout)
        ├─ _acquire: an idle keep-alive connection to that origin, or a new one (connect bound;
        │            the wait for a free slot, past max_connections, has the same bound)
        ├─ one write: request line, headers, body
        └─ H1Response: status and headers once parsed; read() / chunks() as bytes arrive
           (the read bound is the longest silence while the caller waits for bytes)

Why our own: on the router benchmark's one-request-at-a-time path, one call to a worker that
answers a small JSON body took 370 us through aiohttp's client against 170 us through a bare
asyncio protocol (docs/benchmarks/router.md, "The upstream client"); a PD request makes two such
calls, the prefill and the decode stream. The workers speak plain HTTP/1.1 (uvicorn), which is
all this client speaks: one request at a time per connection, bodies sized by Content-Length,
chunked, or the connection's end; an interim (1xx) answer or a protocol upgrade is refused as a
RemoteProtocolError, since no worker sends one. An https:// worker URL goes through aiohttp.

It keeps the contract of the other two clients (pdrouter.router.upstream.client): the same httpx
exception types for the same failures, and a response left before its end closes its connection,
which is how a worker learns that the router gave up on a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from pdrouter.router.upstream.client import (
    KEEPALIVE_S,
    AiohttpUpstream,
    HopTimeout,
    UpstreamResponse,
    _Answer,
)

# A reader slower than its worker (a slow client behind the relay) stops the socket's reads
# once this much body waits unread, so that a stream never buffers without bound.
_PAUSE_BYTES = 256 * 1024


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> tuple[str, int, bytes]:
    """url -> (host, port, the request line's target and Host header, as one prefix)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not a plain http:// URL: {url!r}")
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return (
        parts.hostname,
        port,
        b" %s HTTP/1.1\r\nhost: %s\r\n"
        % (
            path.encode("ascii"),
            parts.netloc.encode("ascii"),
        ),
    )


def _header_lines(headers: Mapping[str, str]) -> bytes:
    for name, value in headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise httpx.LocalProtocolError(f"header {name!r} holds a line break")
    return b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in headers.items())  # fmt: skip


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer in flight on it (at most one)."""

    def __init__(self, upstream: H1Upstream, origin: tuple[str, int]) -> None:
        self.upstream = upstream
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0  # loop time it went back to the pool
        self.idle = False
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False  # the finished answer leaves the connection open
        self.body: list[bytes] = []  # arrived, not yet taken by the reader
        self.num_buffered_bytes = 0
        self.error: httpx.TransportError | None = None  # raised once the body is taken
        self.waiter: asyncio.Future[None] | None = None
        self.read_s = 0.0
        self.last_bytes_at = 0.0  # loop time of the latest bytes
        self.wait_since = 0.0  # loop time the caller began its current wait
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.pause_bytes: float = _PAUSE_BYTES  # unbounded for a caller that wants it all

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_bytes_at = self.loop.time()
        if self.idle or self.complete:
            # Bytes nobody asked for: the worker broke HTTP's one-answer-per-request rule.
            self._fail(httpx.RemoteProtocolError("unexpected bytes from an idle connection"))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer: {exc}"))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.idle:
            self.upstream._forget_idle(self)
            return
        if not self.complete and self.error is None:
            if exc is not None:  # a reset, even where the body would end with the connection
                self.error = httpx.ReadError(f"{type(exc).__name__}: {exc}")
            elif self.head_done and self._body_ends_with_connection():
                self.complete = True
            elif self.head_done:
                self.error = httpx.RemoteProtocolError("the worker closed the connection mid-body")
            else:
                self.error = httpx.RemoteProtocolError(
                    "the worker closed the connection without answering"
                )
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.head_done:  # a second answer to one request: not HTTP/1.1
            raise RuntimeError("a second answer in one exchange")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints, 101 Switching Protocols
            self.error = httpx.RemoteProtocolError(
                f"an interim or upgrade answer (HTTP {status}): workers send none"
            )
            raise ValueError(self.error)  # stops the parser: data_received closes the connection
        self.status = status
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.num_buffered_bytes += len(body)
        if self.num_buffered_bytes > self.pause_bytes and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # reset once the callback returns

    # -- the caller's side ------------------------------------------------------------------

    def _body_ends_with_connection(self) -> bool:
        """An answer with neither Content-Length nor chunked coding ends with the connection."""
        names = {name.lower() for name, _ in self.raw_headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: httpx.TransportError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def send(self, request: bytes, read_s: float) -> None:
        self.read_s = read_s
        self.transport.write(request)

    def _silent_since(self) -> float:
        return max(self.last_bytes_at, self.wait_since)

    def _check_silence(self) -> None:
        """The read bound, with one timer per bound rather than one per read: it fires, looks
        at how long the caller has really waited in silence, and sleeps again for the rest."""
        self.timer = None
        if self.waiter is None:
            return  # the caller is busy elsewhere; its next wait() arms the timer again
        silent_s = self.loop.time() - self._silent_since()
        if silent_s >= self.read_s:
            self._fail(httpx.ReadTimeout(f"no bytes from the worker for {silent_s:.1f} s"))
        else:
            self.timer = self.loop.call_at(self._silent_since() + self.read_s, self._check_silence)

    async def wait(self) -> None:
        """Until more of the answer (or its end, or a failure) arrives."""
        self.wait_since = self.loop.time()
        if self.paused:  # everything buffered was taken: read the socket again
            self.paused = False
            self.transport.resume_reading()
        if self.timer is None:
            self.timer = self.loop.call_at(self.wait_since + self.read_s, self._check_silence)
        waiter = self.loop.create_future()
        self.waiter = waiter
        try:
            await waiter
        finally:
            if self.waiter is waiter:
                self.waiter = None

    def take_body(self) -> bytes:
        body = self.body
        self.body = []
        self.num_buffered_bytes = 0
        return body[0] if len(body) == 1 else b"".join(body)

    def reusable_after(self) -> bool:
        """Whether the answer ended cleanly on a connection the worker keeps open."""
        return (
            self.complete
            and self.error is None
            and self.keep_alive
            and not self.closed
            and not self.transport.is_closing()
        )

    def park(self, now: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.paused:  # the answer's end came in the read that paused the socket
            self.transport.resume_reading()
        self._reset()
        self.parser = httptools.HttpResponseParser(self)
        self.idle = True
        self.idle_since = now


class H1Response(_Answer):
    """A worker's answer: status and headers parsed, the body read as it arrives."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status_code: int = conn.status
        self._raw_headers = conn.raw_headers  # the connection takes a new list for its next call
        self._headers: httpx.Headers | None = None

    @property
    def headers(self) -> Mapping[str, str]:  # case-insensitive
        if self._headers is None:
            self._headers = httpx.Headers(self._raw_headers)
        return self._headers

    async def read(self) -> bytes:
        if self._content is None:
            conn = self._conn
            conn.pause_bytes = math.inf  # the whole body is wanted: no point pausing the socket
            while not conn.complete and conn.error is None:
                await conn.wait()
            if conn.error is not None:
                raise conn.error
            self._content = conn.take_body()
        return self._content

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take_body()
            elif conn.error is not None:
                raise conn.error
            elif conn.complete:
                return
            else:
                await conn.wait()


class _Call:
    """One call, as an async context manager (a class: every call to a worker enters one):
    entering takes a connection, writes the request and waits for the answer's head; leaving
    returns the connection to the pool, or closes it if the answer did not end cleanly."""

    __slots__ = ("_conn", "_origin", "_request", "_timeout", "_upstream")

    def __init__(self, upstream: H1Upstream, method: str, url: str, content: bytes | None,
                 headers: Mapping[str, str], timeout: HopTimeout) -> None:  # fmt: skip
        host, port, target = _target(url)
        body = content or b""
        self._request = b"".join((
            method.encode("ascii"), target, upstream._header_block, _header_lines(headers),
            b"content-length: %d\r\n\r\n" % len(body), body,
        ))  # fmt: skip
        self._upstream = upstream
        self._origin = (host, port)
        self._timeout = timeout
        self._conn: _Connection | None = None

    async def __aenter__(self) -> H1Response:
        conn = await self._upstream._acquire(self._origin, self._timeout.connect_s)
        try:
            conn.send(self._request, self._timeout.read_s)
            while not conn.head_done and conn.error is None:
                await conn.wait()
            if not conn.head_done:
                assert conn.error is not None
                raise conn.error
        except BaseException:
            self._upstream._release(conn)
            raise
        self._conn = conn
        return H1Response(conn)

    async def __aexit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream._release(conn)


class H1Upstream:
    """Keep-alive connections per worker origin, at most max_connections open in all;
    headers go with every call. https:// URLs are passed to an aiohttp client."""

    name = "h1"

    def __init__(self, max_connections: int, headers: Mapping[str, str]) -> None:
        self.max_connections = max_connections
        self.headers = dict(headers)
        self._header_block = _header_lines(self.headers)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}  # oldest first
        self._num_open = 0  # connections open or opening
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._tls: AiohttpUpstream | None = None
        self._closed = False  # aclose() ran: calls still in flight close their connections

    @property
    def num_open(self) -> int:
        return self._num_open

    def num_idle(self, origin: tuple[str, int] | None = None) -> int:
        if origin is not None:
            return len(self._idle.get(origin, ()))
        return sum(len(conns) for conns in self._idle.values())

    def request(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> contextlib.AbstractAsyncContextManager[UpstreamResponse]:
        if url.startswith("https:"):
            if self._tls is None:
                self._tls = AiohttpUpstream(self.max_connections, self.headers)
            return self._tls.request(method, url, content, headers, timeout)
        return _Call(self, method, url, content, headers, timeout)

    # -- the pool ---------------------------------------------------------------------------

    async def _acquire(self, origin: tuple[str, int], connect_s: float) -> _Connection:
        idle = self._idle.get(origin)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()  # the most recently used: the one least likely closing
                # is_closing: the worker's FIN was read this loop turn, connection_lost is next.
                if (
                    not conn.closed
                    and not conn.transport.is_closing()
                    and (now - conn.idle_since < KEEPALIVE_S)
                ):
                    conn.idle = False
                    return conn
                conn.idle = False
                conn.close()
                self._free_slot()
        await self._take_slot(connect_s)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), origin[0], origin[1]
                )
        except TimeoutError as exc:
            self._free_slot()
            raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} "
                                       f"within {connect_s} s") from exc  # fmt: skip
        except OSError as exc:
            self._free_slot()
            raise httpx.ConnectError(f"{origin[0]}:{origin[1]}: {exc}") from exc
        except BaseException:
            self._free_slot()
            raise
        return conn

    def _release(self, conn: _Connection) -> None:
        # With calls waiting for a slot the connection goes, so that its slot passes to the
        # first of them (which may be bound for another worker).
        if conn.reusable_after() and not self._slot_waiters and not self._closed:
            now = conn.loop.time()
            conn.park(now)
            self._idle.setdefault(conn.origin, []).append(conn)
            return
        if conn.timer is not None:
            conn.timer.cancel()
        conn.close()
        self._free_slot()

    def _forget_idle(self, conn: _Connection) -> None:
        """An idle connection the worker closed: off the pool, its slot free."""
        idle = self._idle.get(conn.origin)
        if idle is not None and conn in idle:
            idle.remove(conn)
            self._free_slot()

    async def _take_slot(self, wait_s: float) -> None:
        if self._num_open >= self.max_connections:
            self._close_one_idle()
        if self._num_open < self.max_connections and not self._slot_waiters:
            self._num_open += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                await waiter  # _free_slot counted this connection in before waking us
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._free_slot()  # handed a slot at the moment we gave up: pass it on
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout(
                    f"all {self.max_connections} connections to workers busy for {wait_s} s"
                ) from exc
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._slot_waiters.remove(waiter)

    def _free_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to it: _num_open stays
                return
        self._num_open -= 1

    def _close_one_idle(self) -> None:
        """Past the limit, an idle connection to another worker gives way to a new one."""
        oldest: _Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is not None:
            self._idle[oldest.origin].remove(oldest)
            oldest.idle = False
            oldest.close()
            self._free_slot()

    async def aclose(self) -> None:
        """Closes the idle connections; calls still in flight close theirs when they end."""
        self._closed = True
        idle = [conn for conns in self._idle.values() for conn in conns]
        self._idle.clear()
        for conn in idle:
            conn.idle = False
            conn.close()
            self._free_slot()
        if self._tls is not None:
            await self._tls.aclose()
            self._tls = None
