"""Reading D's SSE stream in batches: exact events, read boundaries anywhere, CRLF, comments,
in-band errors and malformed events as 502 naming D. The byte streams are scripted because a
real D never splits, CRLF-terminates or corrupts its events (fault injection)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from pdrouter.router.upstream.decode_stream import (
    BadEvent,
    event_batches,
    parse_event,
    parse_events,
)
from pdrouter.wire.pd import DecodeEvent

URL = "http://d.example"


class _Reads(httpx.AsyncByteStream):
    """A response body delivered in exactly these reads."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.num_read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for raw in self.reads:
            self.num_read += 1
            yield raw


def _event(k: int, finished: bool = False) -> bytes:
    ev = DecodeEvent(token_ids=[k], text=f" w{k}", num_output_tokens=k + 1, finished=finished,
                     finish_reason="length" if finished else None)  # fmt: skip
    return b"data: " + ev.model_dump_json().encode() + b"\n\n"


async def _batches(reads: list[bytes]) -> tuple[list[list[int]], _Reads]:
    body = _Reads(reads)
    resp = httpx.Response(200, stream=body)
    batches = event_batches(resp.aiter_bytes(), URL)
    out = [[ev.token_ids[0] for ev in batch] async for batch in batches]
    return out, body


async def test_one_batch_per_read_whatever_the_split() -> None:
    stream = _event(1) + _event(2) + _event(3) + _event(4, finished=True)
    cut = len(_event(1)) + 7  # the second event split across two reads
    batches, body = await _batches([stream[:cut], stream[cut:-3], stream[-3:], b""])
    assert batches == [[1], [2, 3], [4]]
    assert body.num_read == 4  # read to the end after the final event: the connection is reusable


async def test_crlf_comments_and_multi_line_data() -> None:
    ev = _event(5, finished=True).decode().rstrip("\n")
    split = ev.replace('"text"', '\r\ndata: "text"', 1)  # one event on two data: lines
    reads = [b": keep-alive\r\n\r\n", split.encode() + b"\r\n\r\n"]
    batches, _ = await _batches(reads)
    assert batches == [[5]]


async def test_nothing_after_the_final_event_is_relayed() -> None:
    batches, _ = await _batches([_event(1, finished=True) + _event(2)])
    assert batches == [[1]]


async def test_in_band_error_is_a_502_naming_d() -> None:
    err = b'data: {"error": {"message": "pool read failed", "type": "server_error"}}\n\n'
    with pytest.raises(BadEvent) as info:
        await _batches([_event(1), err])
    assert info.value.message == f"decode instance {URL} failed: pool read failed"


@pytest.mark.parametrize("data", [b"data: {not json\n\n", b'data: {"token_ids": "x"}\n\n'])
async def test_malformed_event_is_a_502(data: bytes) -> None:
    with pytest.raises(BadEvent) as info:
        await _batches([data])
    assert info.value.message.startswith(f"decode instance {URL} sent a malformed event")


def test_parse_event_ignores_events_without_data() -> None:
    assert parse_event(b"event: ping", URL) is None
    assert parse_event(b": comment", URL) is None


def test_parse_events_validates_a_read_at_once_and_stops_at_the_final_event() -> None:
    blocks = (_event(1) + _event(2) + _event(3, finished=True)).split(b"\n\n")[:-1]
    events = parse_events(blocks, URL)
    assert [(ev.token_ids, ev.finished) for ev in events] == [([1], False), ([2], False),
                                                              ([3], True)]  # fmt: skip
    assert events == [DecodeEvent.model_validate_json(b[6:]) for b in blocks]
    garbage_after_the_end = [*blocks, b"data: {not json"]
    assert parse_events(garbage_after_the_end, URL) == events
    event_after_the_end = [*blocks, _event(4)[:-2]]  # valid, so validated with the rest
    assert parse_events(event_after_the_end, URL) == events
    assert parse_events([b": ping", *blocks[:1]], URL) == events[:1]


def test_two_json_values_in_one_event_are_malformed() -> None:
    one = _event(1)[6:-2]
    with pytest.raises(BadEvent) as info:
        parse_events([b"data: " + one + b"," + one, _event(2)[:-2]], URL)
    assert "malformed event" in info.value.message


async def test_the_final_batch_comes_before_the_rest_of_the_body_is_read() -> None:
    terminator_sent = asyncio.Event()
    num_read = [0]

    async def reads() -> AsyncIterator[bytes]:
        num_read[0] += 1
        yield _event(1) + _event(2, finished=True)
        await terminator_sent.wait()  # D's chunked terminator, in a later packet
        num_read[0] += 1
        yield b""

    batches = event_batches(reads(), URL)
    final = await asyncio.wait_for(batches.__anext__(), 1.0)  # not held back by the drain
    assert [ev.token_ids[0] for ev in final] == [1, 2] and num_read == [1]
    terminator_sent.set()
    with pytest.raises(StopAsyncIteration):
        await batches.__anext__()  # now the body is read to its end
    assert num_read == [2]


async def test_a_body_already_in_is_read_to_its_end_without_arming_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rest_read = []

    async def reads() -> AsyncIterator[bytes]:
        yield _event(1) + _event(2, finished=True)
        rest_read.append(True)  # the drain asked for the rest

    def no_timer(delay_s: float) -> None:
        raise AssertionError(f"a {delay_s} s bound armed for a body that is in")

    monkeypatch.setattr(asyncio, "timeout", no_timer)
    batches = [b async for b in event_batches(reads(), URL, body_complete=lambda: True)]
    assert [[ev.token_ids[0] for ev in batch] for batch in batches] == [[1, 2]]
    assert rest_read == [True]
