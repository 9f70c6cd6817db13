"""Bodies have a deadline and an early answer closes its connection
(pdrouter.common.body_deadline): over raw sockets against uvicorn serving a trivial app with
the guarded protocol (a short body deadline, so the tests are quick)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from pdrouter.common.body_deadline import LINGER_S
from pdrouter.common.http_guard import HeadLimits
from tests.pdrouter.common.guarded_server import guarded_server
from tests.socket_read import read_to_close
from tests.wait import wait_until

BODY_TIMEOUT_S = 1.0
LIMITS = HeadLimits(body_timeout_s=BODY_TIMEOUT_S)
# The server's loop clock may be a millisecond coarse (uvloop's is libuv's, in whole ms): its
# deadline can land up to that much before the client's clock says BODY_TIMEOUT_S (CI: 0.9998).
LOOP_CLOCK_GRAIN_S = 0.001


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/refuse answers 401 without reading the body; every other path reads it whole."""
    if scope["type"] != "http":
        return
    size = 0
    if scope["path"] != "/refuse":
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
    status = 401 if scope["path"] == "/refuse" else 200
    body = f"{size} body bytes".encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[tuple[str, int], uvicorn.Server]]:
    with guarded_server(_app, LIMITS) as (address, srv):
        yield address, srv


def _head(path: str, content_length: int, keep_alive: bool = True) -> bytes:
    connection = "keep-alive" if keep_alive else "close"
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {content_length}\r\n"
            f"Connection: {connection}\r\n\r\n").encode()  # fmt: skip


def _connections(srv: uvicorn.Server) -> int:
    return len(srv.server_state.connections)


def test_a_body_that_stops_coming_is_408_and_closed(
    server: tuple[tuple[str, int], uvicorn.Server],
) -> None:
    address, srv = server
    with socket.create_connection(address, timeout=30) as sock:
        began_s = time.monotonic()
        sock.sendall(_head("/read", 1000) + b"x" * 10)
        answer = read_to_close(sock)
        took_s = time.monotonic() - began_s
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
    assert b"connection: close" in answer
    assert answer.endswith(b"request body not received within 1 s (--body-timeout-s)")
    assert BODY_TIMEOUT_S - LOOP_CLOCK_GRAIN_S <= took_s < BODY_TIMEOUT_S + 5, took_s
    wait_until(lambda: _connections(srv), 5, "the server to drop the connection",
               done=lambda n: n == 0)  # fmt: skip


def test_a_body_trickled_a_byte_at_a_time_still_has_one_deadline(
    server: tuple[tuple[str, int], uvicorn.Server],
) -> None:
    """A gap bound would let a byte every 0.2 s through for good: the deadline is the
    body's whole."""
    address, _ = server
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(_head("/read", 1000))
        began_s = time.monotonic()
        answer = b""
        while time.monotonic() - began_s < BODY_TIMEOUT_S + 5:
            try:
                sock.sendall(b"x")
            except OSError:
                break
            sock.settimeout(0.2)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            break
        sock.settimeout(30)
        answer += read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]


def test_an_answer_before_the_body_says_close_and_the_connection_is_closed(
    server: tuple[tuple[str, int], uvicorn.Server],
) -> None:
    """401 without reading a body declared 1 MB, one byte of which came: the answer says
    Connection: close, the client reads it to its end (the server half-closed), and the
    server drops the connection within LINGER_S although the client keeps it open."""
    address, srv = server
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(_head("/refuse", 1_000_000) + b"x")
        answer = read_to_close(sock)
        assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer[:200]
        assert b"connection: close" in answer
        assert answer.endswith(b"0 body bytes")
        wait_until(lambda: _connections(srv), LINGER_S + 3, "the server to drop the connection",
                   done=lambda n: n == 0)  # fmt: skip


def test_a_client_still_sending_reads_the_early_answer_not_a_reset(
    server: tuple[tuple[str, int], uvicorn.Server],
) -> None:
    """The rest of the body is read and dropped while the server lingers: a client that
    sends its whole 4 MB before it reads gets the 401, and the body's end closes at once."""
    address, srv = server
    size = 4 * 1024 * 1024
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(_head("/refuse", size) + b"x" * size)
        answer = read_to_close(sock, reset_ends=False)
    assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer[:200]
    wait_until(lambda: _connections(srv), 5, "the server to drop the connection",
               done=lambda n: n == 0)  # fmt: skip


def test_bodies_read_whole_keep_the_connection_alive(
    server: tuple[tuple[str, int], uvicorn.Server],
) -> None:
    """Two requests on one connection, each body sent after a pause (a timer armed, then
    cancelled): both answered, no Connection: close, and the second body has its own time."""
    address, _ = server
    with socket.create_connection(address, timeout=30) as sock:
        for _ in range(2):
            sock.sendall(_head("/read", 6) + b"abc")
            time.sleep(BODY_TIMEOUT_S * 0.6)  # under the deadline: the pause being tested
            sock.sendall(b"def")
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
            assert b"connection: close" not in answer
            assert answer.endswith(b"6 body bytes")
