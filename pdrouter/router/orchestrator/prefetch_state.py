"""Prefetch: one request's early-decode state (orchestrator.prefetch sends and ends it; the
decode stage reads it to prefer that D and to say that D answered)."""

from __future__ import annotations

import asyncio


class Prefetch:
    """One request's prefetch: its D, whether D accepted it, whether the decode adopted it."""

    __slots__ = ("accepted", "adopted", "sent", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent: asyncio.Task[None] | None = None
        self.accepted = False
        self.adopted = False

    def may_hold(self) -> bool:
        """Whether D accepted the prefetch, or has not answered yet."""
        return self.accepted or (self.sent is not None and not self.sent.done())

    def decoded_on(self, url: str) -> None:
        """A decode call of the request got 200 from url: D adopted the reservation if url
        is this prefetch's (or released it itself, for a prompt it tokenized otherwise)."""
        if url == self.url:
            self.adopted = True
