"""One keep-alive HTTP/1.1 connection to a worker and the answer in flight on it (httptools).

    data_received -> httptools -> on_header / on_headers_complete / on_body / on_message_complete
    the caller    -> send(request), then wait() until the head, a body piece, the end or an error

An answer's head is bounded: at most MAX_HEAD_BYTES bytes before its body and MAX_HEADERS
header lines (a worker is our own uvicorn: it sends a handful). Past either the connection is
closed and the call fails with httpx.RemoteProtocolError, so a broken or hostile worker that
streams headers forever costs the router a bounded buffer and one failed call.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

# Bounds of one answer's head (status line and headers), like a server's bounds on a request.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100

# A reader slower than its worker (a slow client behind the relay) stops the socket's reads
# once this much body waits unread, so that a stream never buffers without bound.
_PAUSE_BYTES = 256 * 1024


@functools.lru_cache(maxsize=4096)
def request_target(url: str) -> tuple[str, int, bytes]:
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


def header_lines(headers: Mapping[str, str]) -> bytes:
    for name, value in headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise httpx.LocalProtocolError(f"header {name!r} holds a line break")
    return b"".join(
        b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in headers.items()
    )


class H1Connection(asyncio.Protocol):
    """One keep-alive connection and the answer in flight on it (at most one)."""

    def __init__(
        self, origin: tuple[str, int], on_idle_lost: Callable[[H1Connection], None]
    ) -> None:
        self.origin = origin
        self.on_idle_lost = on_idle_lost  # the pool's: an idle connection the worker closed
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
        self.num_head_bytes = 0  # bytes of this answer before its head ended
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
        if not self.head_done:
            # httptools keeps a header it has not seen the end of in its own buffer: an
            # endless one would grow without bound before any callback could refuse it.
            self.num_head_bytes += len(data)
            if self.num_head_bytes > MAX_HEAD_BYTES and not self._head_ends_within(data):
                self._fail(
                    httpx.RemoteProtocolError(
                        f"the answer's head is longer than {MAX_HEAD_BYTES} bytes"
                    )
                )
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer: {exc}"))
            return
        self._wake()

    def _head_ends_within(self, data: bytes) -> bool:
        """Whether the head's last byte came within MAX_HEAD_BYTES (the body may follow)."""
        end = data.find(b"\r\n\r\n")
        return end >= 0 and self.num_head_bytes - len(data) + end + 4 <= MAX_HEAD_BYTES

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.idle:
            self.on_idle_lost(self)
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
        if len(self.raw_headers) >= MAX_HEADERS:
            self.error = httpx.RemoteProtocolError(
                f"the answer has more than {MAX_HEADERS} headers"
            )
            raise ValueError(self.error)  # stops the parser: data_received closes the connection
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
