"""A client that can walk away at any byte: one HTTP/1.1 request over a plain socket.

httpx and the openai client hide when the request is on the wire and when the connection is
closed; a disconnect test needs both exactly, so this sends the request itself and closes the
socket when the test says so.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any
from urllib.parse import urlsplit


class RawRequest:
    """POST json to url over a fresh connection; read as much of the answer as wanted."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        payload = json.dumps(body).encode()
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
        self.sock.sendall(head + payload)
        self.received = b""

    def read_until(self, marker: bytes, count: int = 1, timeout_s: float = 30.0) -> bytes:
        """Read until marker occurs count times in the answer so far (or fail after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while self.received.count(marker) < count:
            remaining_s = deadline - time.monotonic()
            assert remaining_s > 0, f"no {count}x {marker!r} in {timeout_s}s: {self.received!r}"
            self.sock.settimeout(remaining_s)
            data = self.sock.recv(65536)
            assert data, f"connection closed before {count}x {marker!r}: {self.received!r}"
            self.received += data
        return self.received

    def peek(self) -> bytes:
        """What has arrived so far, without waiting for more or consuming it."""
        # select first: a socket with a timeout waits for data in recv(), MSG_DONTWAIT or not
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return self.received
        return self.received + self.sock.recv(65536, socket.MSG_PEEK)

    def close(self) -> None:
        """Walk away: close the socket, as a client process that exits would."""
        self.sock.close()
