"""The router's own HTTP/1.1 client to its workers: the connection pool and the calls.

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

It keeps the contract of the other two clients (pdrouter.router.upstream.contract): the same httpx
exception types for the same failures, and a response left before its end closes its connection,
which is how a worker learns that the router gave up on a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import AsyncIterator, Mapping

import httpx

from pdrouter.router.upstream.aiohttp_client import AiohttpUpstream
from pdrouter.router.upstream.contract import (
    KEEPALIVE_S,
    BufferedAnswer,
    HopTimeout,
    UpstreamResponse,
)
from pdrouter.router.upstream.h1_connection import H1Connection, header_lines, request_target


class H1Response(BufferedAnswer):
    """A worker's answer: status and headers parsed, the body read as it arrives."""

    def __init__(self, conn: H1Connection) -> None:
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

    @property
    def body_complete(self) -> bool:
        return self._conn.complete

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

    def __init__(
        self,
        upstream: H1Upstream,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> None:
        host, port, target = request_target(url)
        body = content or b""
        self._request = b"".join(
            (
                method.encode("ascii"),
                target,
                upstream._header_block,
                header_lines(headers),
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        self._upstream = upstream
        self._origin = (host, port)
        self._timeout = timeout
        self._conn: H1Connection | None = None

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
        self._header_block = header_lines(self.headers)
        self._idle: dict[tuple[str, int], list[H1Connection]] = {}  # oldest first
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

    async def _acquire(self, origin: tuple[str, int], connect_s: float) -> H1Connection:
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
                    lambda: H1Connection(origin, self._forget_idle), origin[0], origin[1]
                )
        except TimeoutError as exc:
            self._free_slot()
            raise httpx.ConnectTimeout(
                f"no connection to {origin[0]}:{origin[1]} within {connect_s} s"
            ) from exc
        except OSError as exc:
            self._free_slot()
            raise httpx.ConnectError(f"{origin[0]}:{origin[1]}: {exc}") from exc
        except BaseException:
            self._free_slot()
            raise
        return conn

    def _release(self, conn: H1Connection) -> None:
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

    def _forget_idle(self, conn: H1Connection) -> None:
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
        oldest: H1Connection | None = None
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
