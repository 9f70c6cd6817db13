"""ProtocolError: a request the server refuses as malformed or unsupported (HTTP 400).

Its own module so that every request check (`pdrouter.wire.openai`, `pdrouter.wire.unsupported`)
raises the one type that the router's and the workers' handlers answer with a 400 naming param.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A request the server refuses as malformed or unsupported (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
