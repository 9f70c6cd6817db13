"""Request heads are bounded (pdrouter.common.http_guard): size and count -> 431, a head not
received in time -> 408, the connection closed each time; over raw sockets against uvicorn
serving a trivial app with the guarded protocol (small limits, so the tests are quick)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from pdrouter.common.http_guard import HeadLimits
from tests.pdrouter.common.guarded_server import guarded_server
from tests.socket_read import read_to_close

LIMITS = HeadLimits(max_header_bytes=8 * 1024, max_headers=20, head_timeout_s=0.5)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = f"{len(scope['headers'])} headers, {size} body bytes".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    with guarded_server(_app, LIMITS) as (address, _):
        yield address


def _exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send data, then read until the server closes (bounded by the socket timeout)."""
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(data)
        return read_to_close(sock, reset_ends=False)


def _request(headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = ["POST / HTTP/1.1", "Host: t", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_a_head_within_the_limits_is_served_and_the_body_is_not_counted(
    server: tuple[str, int],
) -> None:
    headers = [(f"X-H{i}", "v" * 200) for i in range(LIMITS.max_headers - 4)]
    answer = _exchange(server, _request(headers, b"b" * 100_000))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
    assert answer.endswith(f"{len(headers) + 3} headers, 100000 body bytes".encode())


def test_too_many_header_fields_is_431_and_closed(server: tuple[str, int]) -> None:
    headers = [(f"X-H{i}", "v") for i in range(LIMITS.max_headers)]
    answer = _exchange(server, _request(headers))
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert b"connection: close" in answer
    assert answer.endswith(b"more than 20 header fields (--max-headers)")


@pytest.mark.parametrize("num_bytes", [10 * 1024, 16 * 1024 * 1024])
def test_a_head_over_the_byte_limit_is_431_and_closed(
    server: tuple[str, int], num_bytes: int
) -> None:
    """One huge header (also one the size of the issue's 16 MB): refused once the limit is
    passed, without the rest being read."""
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: "
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(head + b"v" * min(num_bytes, 64 * 1024))
        sent = 64 * 1024
        try:
            while sent < num_bytes:  # keep sending until the server refuses and closes
                sock.sendall(b"v" * 65536)
                sent += 65536
        except OSError:
            pass  # reset: the server closed with our bytes unread
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert answer.endswith(b"request head larger than 8192 bytes (--max-header-bytes)")


def test_a_whole_head_over_the_byte_limit_in_one_read_is_431(server: tuple[str, int]) -> None:
    """The head arrives complete in one read: counted as the parser hands it over."""
    answer = _exchange(server, _request([("X-Big", "v" * 10_000)]))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert answer.endswith(b"request head larger than 8192 bytes (--max-header-bytes)")
    answer = _exchange(server, b"GET /" + b"p" * 10_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_a_half_sent_head_is_408_and_closed(server: tuple[str, int]) -> None:
    """The slow client of the issue held its connection for more than 95 s: now the server
    answers 408 and closes once head_timeout_s has passed (the read here is bounded by 30 s)."""
    answer = _exchange(server, b"GET / HTTP/1.1\r\nHost: t\r\nX-Half: ")
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
    assert answer.endswith(b"request head not received within 0.5 s (--head-timeout-s)")


def test_a_connection_that_sends_nothing_is_closed_silently(server: tuple[str, int]) -> None:
    assert _exchange(server, b"") == b""


def test_keep_alive_requests_each_get_the_full_head_limit(server: tuple[str, int]) -> None:
    """Two requests on one connection: the counts start again for the second head."""
    headers = [(f"X-H{i}", "v" * 300) for i in range(LIMITS.max_headers - 4)]
    first = _request(headers).replace(b"Connection: close", b"Connection: keep-alive")
    answer = _exchange(server, first + _request(headers))
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer[:400]


def test_limits_too_small_to_serve_are_refused() -> None:
    with pytest.raises(ValueError, match="head limits too small"):
        HeadLimits(max_header_bytes=10)
