"""D's SSE stream read fast: each network read parsed into one batch of events.

    D ──► "data: {ev}\\n\\ndata: {ev}\\n\\n" ... ──► [ev, ev] per read ──► one client write

Why not httpx-sse: it decodes line by line through several generator layers, and the router
relays every token of every stream, so that cost is paid per token. Reading whole reads lets
the router relay all the events one read brought in a single write to the client (each one
still its own SSE event), instead of one socket write per token: the writes, not the parsing,
were most of the router's CPU per streamed token.

After D's final event the rest of the body (the chunked-encoding terminator) is read, within
a short bound, so that the connection returns to the pool instead of being closed: otherwise
every request would open a new connection to D.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
from pydantic import TypeAdapter, ValidationError

from pdrouter.router.instances.call_guard import CallGuard
from pdrouter.router.upstream.token_events import TokenEvent, token_events, token_run
from pdrouter.wire.pd import DecodeEvent

# How long to wait for the end of D's body after its final event; past it the connection is
# dropped instead of reused (a D that keeps a finished stream open costs no client time).
DRAIN_BOUND_S = 1.0

# A read's events validated in one call, as one JSON array: half the cost per event of one
# call each (1.9 against 3.3 us per event, measured with timeit on 31 events).
_EVENT_LIST = TypeAdapter(list[DecodeEvent])


class BadEvent(Exception):
    """D's stream broke the contract: an in-band error event, or an event that is not a
    DecodeEvent. The decode stage treats it as a failed attempt (orchestrator.failures)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parse_event(block: bytes, url: str) -> DecodeEvent | None:
    """One SSE event (the lines between blank lines) as a DecodeEvent; None for a comment or
    an event without data. D's in-band error event, or anything malformed, raises BadEvent."""
    if block[:6] == b"data: " and b"\n" not in block:
        data = block[6:]  # what our workers send: one data line per event
    else:
        lines = block.split(b"\n")
        data_lines = [line[5:].lstrip(b" ") for line in lines if line[:5] == b"data:"]
        if not data_lines:
            return None
        data = data_lines[0] if len(data_lines) == 1 else b"\n".join(data_lines)
    try:
        return DecodeEvent.model_validate_json(data)
    except ValidationError as exc:
        try:
            payload = json.loads(data)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and "error" in payload:
            error = payload["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise BadEvent(f"decode instance {url} failed: {message}") from None
        raise BadEvent(f"decode instance {url} sent a malformed event: {exc}") from None


def parse_events(blocks: list[bytes], url: str) -> list[DecodeEvent]:
    """The events of one read's blocks, in order (comments and data-less events dropped), up
    to the first finished one. Blocks our workers write (one `data:` line each) are validated
    together; anything else, or a batch that fails, is parsed block by block, so that an error
    names its event and nothing after the final event counts."""
    payloads = []
    for block in blocks:
        if block[:6] != b"data: " or b"\n" in block:
            payloads = None
            break
        payloads.append(block[6:])
    if payloads:
        try:
            events = _EVENT_LIST.validate_json(b"[" + b",".join(payloads) + b"]")
        except ValidationError:
            events = None
        # One element per payload, or some payload held more than one JSON value.
        if events is not None and len(events) == len(payloads):
            for i, event in enumerate(events):
                if event.ends_stream:  # a group's: its last sequence's final event
                    return events[: i + 1]
            return events
    events = []
    for block in blocks:
        event = parse_event(block, url)
        if event is not None:
            events.append(event)
            if event.ends_stream:
                break
    return events


def read_events(events: bytes, url: str) -> list[DecodeEvent | TokenEvent]:
    """The events of whole SSE events (a read's, up to its last blank line): a run of token
    events in our workers' form matched (token_events), the rest parsed (parse_events)."""
    num_matched = token_run(events)
    if num_matched == len(events):
        return token_events(events)  # type: ignore[return-value]
    rest = parse_events(events[num_matched:].split(b"\n\n")[:-1], url)
    return [*token_events(events[:num_matched]), *rest] if num_matched else rest  # type: ignore[list-item]


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    async for _ in chunks:
        pass


async def event_batches(
    chunks: AsyncIterator[bytes],
    url: str,
    guard: CallGuard | None = None,
    body_complete: Callable[[], bool] | None = None,
) -> AsyncIterator[list[DecodeEvent | TokenEvent]]:
    """D's events from its body's reads (UpstreamResponse.chunks()), one list per read (never
    empty); the stream ends after the event with finished=True (anything D sent after it in
    the same read is ignored). Each read is awaited through guard (the call's CallGuard: the
    call is given up if D is found down meanwhile) when one is given. The rest of D's body is
    drained after the final batch is yielded, when the consumer asks for more: a consumer that
    stops there closes it instead. body_complete (UpstreamResponse.body_complete): when it
    says the body is in by then, as it is when D's last write held the final event and the
    body's end together, the rest is read without arming the drain's bound."""
    buffer = b""
    while True:
        read = anext(chunks, None)
        raw = await (read if guard is None else guard.call(read))
        if raw is None:
            return
        buffer += raw
        if b"\r" in buffer:  # SSE allows CRLF line ends; our workers send LF
            buffer = buffer.replace(b"\r\n", b"\n")
        end = buffer.rfind(b"\n\n") + 2
        if end == 1:  # no whole event yet
            continue
        batch = read_events(buffer[:end], url)
        buffer = buffer[end:]
        if not batch:
            continue
        yield batch
        if batch[-1].ends_stream:
            # Resumed once the consumer has relayed the final batch: the rest of D's body is
            # read now, so that the connection goes back to the pool (see the module
            # docstring) without the client waiting for it.
            with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError):
                if body_complete is not None and body_complete():
                    await _drain(chunks)  # nothing to wait for: no timer (a few us each)
                else:
                    async with asyncio.timeout(DRAIN_BOUND_S):  # no task, unlike wait_for
                        await _drain(chunks)
            return
