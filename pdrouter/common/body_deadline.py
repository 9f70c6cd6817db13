"""How long a request's body may take, and what an answer sent before its body ended does to
the connection: the body half of http_guard's protocol (uvicorn's httptools protocol).

    body not complete --body-timeout-s (30 s)     408 and closed (closed at once when the
      after the head ended                         answer is already out)
    answer sent before the body ended            Connection: close; the rest of the body is
      (401, 405, 413, 400 context_length_...)     read and dropped for at most LINGER_S,
                                                   then the connection is closed

The deadline bounds the whole body, counted from the end of the head, rather than the gap
between reads (nginx's client_body_timeout): a client trickling a byte every few seconds would
pass a gap bound for good. Unbounded, a client that sent part of a body held its connection,
and whatever the app had buffered, forever: 1,000 connections x 190 KB took the router from 88
to 262 MB. The apps read a body before any other work, so the deadline measures the client,
not the app.

An answer that leaves before its request's body was read (a refusal: no key, wrong method,
too large) closes the connection: kept open, a client that sent one body byte and then nothing
held it for good (2,000 such sockets held 2,000 descriptors). Closing at once would reset a
client still sending, which then may never read the answer; so, as nginx's lingering close,
the server half-closes and drops what still arrives for at most LINGER_S.

Memory: an unread body costs at most uvicorn's read buffer (it stops reading past
HIGH_WATER_LIMIT, 64 KiB), a body being read at most the body bound (body_limit), each for at
most the body deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

STATUS_BODY_TIMEOUT = 408
# How long a connection answered before its body ended keeps reading (and dropping) that body
# so that the client reads the answer rather than a reset (nginx's lingering_timeout is 5 s).
LINGER_S = 2.0

Send = Callable[[Any], Awaitable[None]]


class BodyDeadlineProtocol(HttpToolsProtocol):
    """The body deadline and the close after an early answer; a subclass sets body_timeout_s
    and calls _start_body_timer after each read (GuardedHttpToolsProtocol)."""

    body_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._body_cycle: RequestResponseCycle | None = None  # whose body is still arriving
        self._closing_cycle: RequestResponseCycle | None = None  # its answer said close
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline_s = 0.0  # loop time; 0: no timer armed for this body yet

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _start_body_timer(self) -> None:
        """After a read: arm the deadline of a body still arriving, and have its answer watched
        (_guarded_send). Only for a body that outlasts the read its head came in: most requests
        arrive whole, and pay for neither. The app's task has not run yet (it starts after this
        read), so it takes the guarded send."""
        cycle = self._body_cycle
        if cycle is not None and self._body_timer is None and not self.transport.is_closing():
            if self._body_deadline_s == 0.0:
                cycle.send = self._guarded_send(cycle, cycle.send)  # type: ignore[method-assign]
            self._body_deadline_s = self.loop.time() + self.body_timeout_s
            self._body_timer = self.loop.call_at(self._body_deadline_s, self._body_timed_out)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a new cycle
            self._body_cycle = cycle
            self._body_deadline_s = 0.0

    def on_message_complete(self) -> None:
        cycle = self._body_cycle
        self._body_cycle = None
        self._cancel_body_timer()
        super().on_message_complete()
        if cycle is not None and cycle.response_complete:  # lingering: the body has ended
            self.transport.close()

    def _guarded_send(self, cycle: RequestResponseCycle, send: Send) -> Send:
        """cycle's send, but an answer that starts before the request's body ended says
        Connection: close (on_response_complete then lingers and closes)."""

        async def guarded(message: Any) -> None:
            if message["type"] != "http.response.start" or self._body_cycle is not cycle:
                await send(message)
                return
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"connection" for name, _ in headers):
                headers.append((b"connection", b"close"))
            await send({**message, "headers": headers})
            self._closing_cycle = cycle
            cycle.keep_alive = True  # so that uvicorn leaves the closing to on_response_complete

        return guarded

    def on_response_complete(self) -> None:
        cycle = self._closing_cycle
        if cycle is None or not cycle.response_complete or self.transport.is_closing():
            super().on_response_complete()
            return
        self._closing_cycle = None
        self.server_state.total_requests += 1
        if self._body_cycle is not cycle:  # the body ended while the answer was written
            self.transport.close()
            return
        # Half-close, and drop what still arrives (uvicorn's on_body ignores the body of an
        # answered request) for at most LINGER_S, never past the body deadline.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._cancel_body_timer()
        linger_until_s = self.loop.time() + LINGER_S
        if self._body_deadline_s:
            linger_until_s = min(linger_until_s, self._body_deadline_s)
        self._body_timer = self.loop.call_at(linger_until_s, self._body_timed_out)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self._body_cycle
        if cycle is None or self.transport.is_closing():
            return
        if cycle.response_started:  # the answer is out (or going): nothing left to say
            self.transport.close()
            return
        self._refuse(
            STATUS_BODY_TIMEOUT,
            f"request body not received within {self.body_timeout_s:g} s (--body-timeout-s)",
        )
        # The app, waiting for the rest of the body, reads a disconnect; whatever it still
        # sends goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()

    def _refuse(self, status: int, message: str) -> None:
        """Answer status with a plain-text message and close the connection."""
        body = message.encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
