"""Bounds on a request's head (request line + headers), below the app: uvicorn's httptools
protocol with three limits.

    head bytes    > --max-header-bytes (64 KiB)   431, connection closed
    header fields > --max-headers (100)           431, connection closed
    head not complete --head-timeout-s (10 s)     408 (closed silently if nothing arrived)
      after the connection opened or the request's first byte
    body not complete --body-timeout-s (30 s)     408, connection closed
      after the head ended                         (pdrouter.common.body_deadline)

Unbounded, a 16 MB header and 20,000 headers were both served, and a client that sent half its
headers held its connection for good, so a few thousand such connections exhausted the file
descriptors. uvicorn's httptools protocol has no such limits (h11's
`h11_max_incomplete_event_size` bounds bytes only): this subclass counts the head's bytes as
the parser hands them over (URL, each header field) and, for a head still incomplete after a
read, every byte received since it began (the parser buffers those: each read adds at most one
transport read), counts the header fields, and arms one timer per head. Router and workers pass
`guarded_protocol(limits)` as uvicorn's `http` protocol class. Body size is bounded apart
(pdrouter.common.body_limit); the body's time, and the close of a connection answered before
its body ended, by the base class (pdrouter.common.body_deadline).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httptools

from pdrouter.common.body_deadline import BodyDeadlineProtocol
from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import flag

# The statuses this module answers (for the apps' lists of error statuses).
STATUS_HEAD_TIMEOUT = 408
STATUS_HEADERS_TOO_LARGE = 431


@dataclass(frozen=True)
class HeadLimits:
    """Bounds on one request's head, and on its body's time (the same flags for router and
    workers)."""

    max_header_bytes: int = field(
        default=64 * 1024,
        metadata=flag(
            "--max-header-bytes",
            "largest request head (request line + headers); a longer one gets 431",
        ),
    )
    max_headers: int = field(
        default=100, metadata=flag("--max-headers", "most header fields in a request; more get 431")
    )
    head_timeout_s: float = field(
        default=10.0,
        metadata=flag(
            "--head-timeout-s",
            "time a client has to send a request's head once it connected or "
            "began it; then 408 and the connection is closed",
        ),
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--body-timeout-s",
            "time a client has to send a request's whole body once its head ended; then 408 "
            "and the connection is closed",
        ),
    )

    def __post_init__(self) -> None:
        timeouts_s = (self.head_timeout_s, self.body_timeout_s)
        if self.max_header_bytes < 1024 or self.max_headers < 8 or min(timeouts_s) <= 0:
            raise ConfigError(
                f"head limits too small to serve anything: {self} (at least 1024 bytes, 8 "
                "headers and positive timeouts)"
            )


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal is on the protocol."""


class GuardedHttpToolsProtocol(BodyDeadlineProtocol):
    """uvicorn's httptools protocol with HeadLimits (set on the class by guarded_protocol)."""

    head_limits = HeadLimits()
    body_timeout_s = head_limits.body_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refusal: tuple[int, str] | None = None
        self._head_bytes = 0  # of the current head: URL and header fields parsed so far
        self._pending_bytes = 0  # received since the current head began, while incomplete
        self._num_headers = 0
        self._reading_head = True  # waiting for (the rest of) a request's head
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, with a refusal of ours answered as such (not as a 400).
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._reading_head and self.parser is not None and not self.transport.is_closing():
            self._pending_bytes += len(data)
            if self._pending_bytes > self.head_limits.max_header_bytes:
                self._refuse(*self._too_large())
        else:
            self._start_body_timer()

    def _too_large(self) -> tuple[int, str]:
        limit = self.head_limits.max_header_bytes
        return (
            STATUS_HEADERS_TOO_LARGE,
            f"request head larger than {limit} bytes (--max-header-bytes)",
        )

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self.head_limits.max_header_bytes:
            self._refusal = self._too_large()
            raise _Refused

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head = True
        self._head_bytes = 0
        self._pending_bytes = 0
        self._num_headers = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.head_limits.max_headers:
            self._refusal = (
                STATUS_HEADERS_TOO_LARGE,
                f"more than {self.head_limits.max_headers} header fields (--max-headers)",
            )
            raise _Refused
        self._count(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(
            self.head_limits.head_timeout_s, self._head_timed_out
        )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._reading_head or self.transport.is_closing():
            return
        if self._pending_bytes == 0 and self._head_bytes == 0:
            self.transport.close()  # a connection that never sent a byte: nothing to answer
            return
        self._refuse(
            STATUS_HEAD_TIMEOUT,
            f"request head not received within {self.head_limits.head_timeout_s:g} s "
            "(--head-timeout-s)",
        )

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_head_timer()
        self._reading_head = False
        super()._refuse(status, message)


def guarded_protocol(limits: HeadLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for uvicorn's `http=` with these limits."""
    attributes = {"head_limits": limits, "body_timeout_s": limits.body_timeout_s}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attributes)
