"""RequestContext: one client request on its way through the router, P to D."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdrouter.router.observability.timeline import Timeline
from pdrouter.router.observability.trace import RequestTrace
from pdrouter.router.orchestrator.prefetch_state import Prefetch
from pdrouter.router.tenancy.usage_meter import UsageMeter
from pdrouter.wire.choices import ChoicePlan
from pdrouter.wire.pd import Endpoint
from pdrouter.wire.responses import ResponseFrame
from pdrouter.wire.tool_stream import chat_frame

if TYPE_CHECKING:
    from pdrouter.router.tenancy.limits import Ticket


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
    # The most tokens one sequence may generate: max_tokens, else what the context leaves
    # (RouterService._accept); what the request reserves on its key and on D.
    max_output_tokens: int = 0
    # The prefix cache scope P and D hash its blocks under (pdrouter.wire.pd.cache_scope).
    cache_scope: str | None = None
    # A request of several sequences (batch, n, best_of, echo): orchestrator.choices.
    plan: ChoicePlan | None = None
    # Lower is served first (vLLM's): the body's field, else X-Priority, else the API key's
    # default (router.tenancy.gate; None until it decides). The ticket: its key's charge.
    priority: int | None = None
    ticket: Ticket | None = None
    trace: RequestTrace | None = None  # its trace context, when tracing is on
    # (tool mode, forced function): how the answer's text becomes tool calls (tool_stream).
    tools: tuple[str, str | None] = ("none", None)

    # The task serving the request (None: the task that makes each call).
    task: asyncio.Task[Any] | None = None
    system_fingerprint: str | None = None
    # Where each hop ran (the last instance tried), for the request's log line.
    prefill_url: str = ""
    decode_urls: list[str] = field(default_factory=list)
    timeline: Timeline | None = None  # the debug timeline, when the app keeps one
    # The early decode's prefetch on the D picked at the start (orchestrator.prefetch).
    prefetch: Prefetch | None = None
    # time.monotonic() when P's result arrived (0.0: none came, or D prefilled the prompt):
    # the handoff left after P's first token is measured from it to D's first event.
    prefill_done_s: float = 0.0
    decode_first_s: float = 0.0  # time.monotonic() at D's first event with tokens (0.0: none)
    # The answer as the client got it (answered()), for the request's end: its metrics and
    # its log line. answered_s stays 0.0 until the answer is complete.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Of a request of several sequences: its longest sequence's output tokens (they decode
    # side by side: its time per output token is theirs); 0: one sequence, num_output_tokens.
    num_sequence_tokens: int = 0
    first_token_s: float = 0.0
    answered_s: float = 0.0
    # What it used so far, counted as it is relayed (shared by its sub-requests' copies).
    meter: UsageMeter = field(default_factory=UsageMeter)
    prompt_index: int = 0  # a sub-request's prompt in its request's batch (the meter's key)
    # The tokens it reserved on the decode side at the door (Selector.ensure_room), given
    # back at its end.
    num_tokens_reserved: int = 0
    _frame: ResponseFrame | None = field(default=None, repr=False)

    @property
    def key_id(self) -> str | None:
        """The id of the keys-file API key the request came with (None: another key)."""
        return self.ticket.key.key_id if self.ticket is not None else None

    @property
    def num_sequences(self) -> int:
        """The sequences its answer samples: each prompt's n (or best_of), 1 without a plan."""
        return self.plan.num_sub_requests if self.plan is not None else 1

    @property
    def num_tokens_bound(self) -> int:
        """The most tokens it can hold: its prompts once, each sequence's output budget."""
        return self.prompt_tokens_estimate + self.max_output_tokens * self.num_sequences

    def time_per_output_token_s(self) -> float | None:
        """Its answer's mean gap between output tokens after the first (None: one token):
        of several sequences, its longest's, which decoded beside the others."""
        num_tokens = self.num_sequence_tokens or self.num_output_tokens
        if num_tokens < 2:
            return None
        return (self.answered_s - self.first_token_s) / (num_tokens - 1)

    def mark(self, event: str, **detail: Any) -> None:
        if self.timeline is not None:
            self.timeline.mark(event, **detail)

    def answered(
        self, num_prompt_tokens: int, num_output_tokens: int, first_token_s: float, now_s: float
    ) -> None:
        """The answer is complete (now_s: time.monotonic() as its last write was made)."""
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.first_token_s = first_token_s
        self.answered_s = now_s

    def frame(self) -> ResponseFrame:
        """This request's ResponseFrame, made once, with the bytes its chunks share."""
        if self._frame is None:
            frame = ResponseFrame(
                self.endpoint,
                self.request_id,
                self.model,
                system_fingerprint=self.system_fingerprint,
            )
            self._frame = chat_frame(frame, *self.tools)
            _ = self._frame.text_chunk_parts  # computed now, with the frame's head
        return self._frame
