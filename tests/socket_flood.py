"""Many raw sockets held open against a server process, and the descriptors it holds: for the
tests that check a server lets go of connections it has answered."""

from __future__ import annotations

import os
import resource
import socket
import time

from tests.socket_read import read_to_close
from tests.wait import wait_until


def open_fds(pid: int) -> int:
    """How many file descriptors process pid holds now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def ensure_fd_limit(needed: int) -> None:
    """Raise this process's soft descriptor limit to needed (within the hard limit); servers
    started afterwards inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise RuntimeError(f"need {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def post_head(host: str, path: str, content_length: int, headers: dict[str, str]) -> bytes:
    """A POST's head declaring content_length bytes of JSON body."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {content_length}"]
    lines += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def open_with_partial_bodies(
    address: tuple[str, int], data: bytes, count: int, timeout_s: float = 60.0
) -> list[socket.socket]:
    """count connections, each sent data (a head and part of its body) and left open."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection(address, timeout=timeout_s)
            socks.append(sock)
            sock.sendall(data)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def expect_all_408_and_closed(
    socks: list[socket.socket],
    pid: int,
    baseline_fds: int,
    within_s: float,
    slack_s: float,
    what: str,
) -> None:
    """Each of socks (sent a head and part of a body) reads a 408 ending in the
    --body-timeout-s hint and is closed within within_s, and process pid is back to
    baseline_fds descriptors within slack_s after; closes socks in any case."""
    try:
        began_s = time.monotonic()
        for sock in socks:
            answer = read_to_close(sock)
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
            assert answer.endswith(b" (--body-timeout-s)"), answer[-200:]
        assert time.monotonic() - began_s < within_s
        wait_until(lambda: open_fds(pid), slack_s, f"{what} to drop the connections",
                   done=lambda n: n <= baseline_fds)  # fmt: skip
    finally:
        for sock in socks:
            sock.close()
