"""The bodies one process is still reading are bounded over all connections
(pdrouter.common.body_limit.PendingBodies): past the bound a body is refused with 503 and
Retry-After, and every byte counted is given back however its body ends. Raw sockets against
uvicorn (the guarded protocol) serving an app that reads bodies with read_body under a small
bound."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from pdrouter.common.body_limit import PendingBodies, body_limit, read_body
from pdrouter.common.http_guard import HeadLimits
from pdrouter.wire.errors import APIError
from tests.pdrouter.common.guarded_server import guarded_server
from tests.socket_read import read_to_close
from tests.wait import wait_until

PENDING = PendingBodies(1000)
LIMIT = body_limit(100_000, None, 64, "--max-body-bytes")


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    try:
        body = await read_body(receive, LIMIT, None, PENDING)
        status, answer, headers = 200, f"{len(body)} body bytes".encode(), []
    except APIError as exc:
        if exc.status == 499:
            return
        status, answer = exc.status, exc.message.encode()
        headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
    headers.append((b"content-length", str(len(answer)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    with guarded_server(_app, HeadLimits()) as (address, _):
        yield address


def _one_answer(sock: socket.socket) -> bytes:
    """One answer on a kept-alive connection (it has a Content-Length and fits one read)."""
    return sock.recv(65536)


def _head(content_length: int) -> bytes:
    return f"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: {content_length}\r\n\r\n".encode()


def test_bodies_past_the_bound_are_503_and_every_byte_is_given_back(
    server: tuple[str, int],
) -> None:
    first = socket.create_connection(server, timeout=30)
    second = socket.create_connection(server, timeout=30)
    try:
        for sock in (first, second):
            sock.sendall(_head(1000) + b"x" * 400)
        wait_until(
            lambda: PENDING.held_bytes, 10, "two partial bodies held", done=lambda n: n == 800
        )
        with socket.create_connection(server, timeout=30) as third:
            third.sendall(_head(1000) + b"x" * 400)
            answer = read_to_close(third)
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer[:200]
        assert b"retry-after: 1\r\n" in answer and b"connection: close" in answer
        assert answer.endswith(b"bytes of request bodies still arriving; retry later")
        assert PENDING.held_bytes == 800
        first.sendall(b"y" * 600)  # one body completes: answered, its bytes given back
        assert _one_answer(first).endswith(b"1000 body bytes")
        wait_until(
            lambda: PENDING.held_bytes, 10, "the first body given back", done=lambda n: n == 400
        )
    finally:
        first.close()
        second.close()  # a body cut short gives its bytes back too
    wait_until(lambda: PENDING.held_bytes, 10, "every byte given back", done=lambda n: n == 0)
