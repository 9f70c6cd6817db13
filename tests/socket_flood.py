"""Many raw sockets held open against a server process, and the descriptors it holds: for the
tests that check a server lets go of connections it has answered."""

from __future__ import annotations

import os
import resource
import socket


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
