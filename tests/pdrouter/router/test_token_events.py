"""D's token events matched without a model: the same fields as DecodeEvent's validation, the
same client bytes as ResponseFrame.chunk, and everything the regex does not take (other
forms, escapes, the final event, bad UTF-8) left to validation, which judges it as before."""

from __future__ import annotations

import pytest

from pdrouter.router.upstream.decode_stream import BadEvent, read_events
from pdrouter.router.upstream.token_events import OutputIds, TokenEvent, token_events, token_run
from pdrouter.wire.pd import DecodeEvent, decode_event_sse
from pdrouter.wire.responses import ResponseFrame

URL = "http://d.example"
# Matched: no quote, backslash or control character (non-ASCII and U+2028 are plain bytes).
PLAIN = [" w5", "", "héllo", "日本語", "😀", "\u2028\u2029", "\x7f", "</script>", "a/b"]
# Escaped by D's encoder: never matched, validated.
ESCAPED = ['q"uote', "back\\slash", "new\nline", "tab\t", "\x01\x1f", "\x00text\x00"]
FIELDS = (*DecodeEvent.model_fields, "ends_stream", "num_token_ids")  # every field, a new one too


def _sse(text: str, ids: list[int] | None = None, k: int = 1, **extra: object) -> bytes:
    ev = DecodeEvent(token_ids=ids or [1000 + k], text=text, num_output_tokens=k + 1, **extra)  # type: ignore[arg-type]
    return decode_event_sse(ev)


def _fields(ev: object) -> tuple[object, ...]:
    return tuple(getattr(ev, name) for name in FIELDS)


def test_every_field_is_the_validated_events() -> None:
    for text in PLAIN:
        for ids in ([7], [0, 12, 345]):
            raw = _sse(text, ids, k=41)
            assert token_run(raw) == len(raw), (text, ids)
            (ev,) = token_events(raw)
            assert type(ev) is TokenEvent
            assert _fields(ev) == _fields(DecodeEvent.model_validate_json(raw[6:-2]))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_spliced_chunk_is_the_frames_own(endpoint: str) -> None:
    frame = ResponseFrame(endpoint, "req-1", "m", created=7)  # type: ignore[arg-type]
    head, tail = frame.text_chunk_parts  # type: ignore[misc]
    for text in PLAIN[:1] + PLAIN[2:]:  # the relay writes no chunk for an empty text
        (ev,) = token_events(_sse(text))
        assert head + ev.text_json + tail == frame.chunk(text), repr(text)


def test_what_is_not_our_workers_token_form_is_validated() -> None:
    every_field = DecodeEvent(token_ids=[1], text="a", num_output_tokens=2).model_dump_json()
    full = b"data: " + every_field.encode() + b"\n\n"
    spaced = b'data: {"token_ids": [1], "text": "a", "num_output_tokens": 2}\n\n'
    reordered = b'data: {"text":"a","token_ids":[1],"num_output_tokens":2}\n\n'
    leading_zero = b'data: {"token_ids":[01],"text":"a","num_output_tokens":2}\n\n'
    no_ids = b'data: {"token_ids":[],"text":"a","num_output_tokens":2}\n\n'
    for raw in [full, spaced, reordered, no_ids, *(_sse(t) for t in ESCAPED)]:
        assert token_run(raw) == 0, raw
        (ev,) = read_events(raw, URL)
        assert type(ev) is DecodeEvent
    assert token_run(leading_zero) == 0
    with pytest.raises(BadEvent):  # JSON has no leading zeros: malformed, as before
        read_events(leading_zero, URL)


def test_a_read_is_its_token_run_then_the_rest_validated_up_to_the_final_event() -> None:
    final = _sse("!", k=3, finished=True, finish_reason="length", num_blocks_loaded=2)
    read = _sse(" a", k=1) + _sse(" b", k=2) + final + _sse(" late", k=4)
    events = read_events(read, URL)
    assert [type(ev) for ev in events] == [TokenEvent, TokenEvent, DecodeEvent]
    assert [(ev.text, ev.num_output_tokens, ev.finished) for ev in events] == [
        (" a", 2, False), (" b", 3, False), ("!", 4, True)]  # fmt: skip
    assert events[2].num_blocks_loaded == 2
    escaped_middle = _sse(" a") + _sse('q"') + _sse(" c")  # matching stops at the escape
    assert [type(ev) for ev in read_events(escaped_middle, URL)] == [TokenEvent, DecodeEvent,
                                                                     DecodeEvent]  # fmt: skip


def test_text_that_is_not_utf8_is_malformed_as_before() -> None:
    bad = b'data: {"token_ids":[1],"text":"\xff\xfe","num_output_tokens":2}\n\n'
    assert token_run(bad) == 0
    assert token_run(_sse(" ok") + bad) == 0  # the run is given up whole: validated
    with pytest.raises(BadEvent) as info:
        read_events(_sse(" ok") + bad, URL)
    assert info.value.message.startswith(f"decode instance {URL} sent a malformed event")


def test_output_ids_keep_the_order_of_matched_and_validated_events() -> None:
    ids = OutputIds([7])

    def add(read: bytes) -> None:
        for ev in read_events(read, URL):
            ids.add(ev)

    add(_sse(" a", [8]) + _sse(" b", [9, 10]) + _sse('q"', [11]))  # two matched, one validated
    add(_sse(" c", [12]))
    add(_sse("", [13], finished=True, finish_reason="length"))
    assert ids.ids() == [7, 8, 9, 10, 11, 12, 13]
    add(_sse(" d", [14]))  # asked again after more came
    assert ids.ids() == [7, 8, 9, 10, 11, 12, 13, 14]
