"""Reading a raw socket's answer to the end, for the tests that speak bytes to a server."""

from __future__ import annotations

import socket


def read_to_close(sock: socket.socket, reset_ends: bool = True) -> bytes:
    """Everything the peer sends until it closes (bounded by the socket's timeout); with
    reset_ends, a reset ends the answer too (a server that closes with our bytes unread)."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        if not reset_ends:
            raise
    return answer
