"""RequestContext: one client request on its way through the router, P to D."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdrouter.router.observability.timeline import Timeline
from pdrouter.wire.pd import Endpoint
from pdrouter.wire.responses import ResponseFrame


@dataclass
class RequestContext:
    """One client request on its way through the router."""

    request_id: str
    endpoint: Endpoint
    body: bytes  # the validated OpenAI body as JSON, seed fixed: what P and D get
    model: str
    include_usage: bool
    arrival_s: float  # time.monotonic() at arrival
    prompt_tokens_estimate: int = 1  # P's load before it has tokenized (admission)
    max_output_tokens: int = 0  # the client's output budget (0: unset)

    # The task serving the request (None: whichever task calls the orchestrator).
    task: asyncio.Task[Any] | None = None
    system_fingerprint: str | None = None
    # Where each hop ran (the last instance tried), for the request's log line.
    prefill_url: str = ""
    decode_urls: list[str] = field(default_factory=list)
    timeline: Timeline | None = None  # the debug timeline, when the app keeps one
    _frame: ResponseFrame | None = field(default=None, repr=False)

    def mark(self, event: str, **detail: Any) -> None:
        if self.timeline is not None:
            self.timeline.mark(event, **detail)

    def frame(self) -> ResponseFrame:
        """This request's ResponseFrame, made once, with the bytes its chunks share."""
        if self._frame is None:
            self._frame = ResponseFrame(
                self.endpoint,
                self.request_id,
                self.model,
                system_fingerprint=self.system_fingerprint,
            )
            _ = self._frame.text_chunk_parts  # computed now, with the frame's head
        return self._frame
