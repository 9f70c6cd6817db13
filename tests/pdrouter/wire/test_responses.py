"""The OpenAI bodies the router assembles from P's first token and D's events: exact bytes."""

from __future__ import annotations

import json

from pdrouter.wire.logprobs import TokenLogprob, TopLogprob
from pdrouter.wire.pd import DecodeEvent, KVHandle, PrefillResult
from pdrouter.wire.responses import SSE_DONE, ResponseFrame


def _data(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[len(b"data: ") : -2])


def test_chat_stream_chunks() -> None:
    frame = ResponseFrame("chat", "r1", "tiny", created=1700000000)
    head = {"id": "chatcmpl-r1", "created": 1700000000, "model": "tiny",
            "system_fingerprint": None, "object": "chat.completion.chunk",
            "usage": None}  # fmt: skip
    first = _data(frame.chunk("He", first=True))
    assert first == {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                     "content": "He"}, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    assert _data(frame.chunk("llo"))["choices"][0]["delta"] == {"content": "llo"}
    last = _data(frame.chunk("", "length"))
    assert last["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    usage = _data(frame.usage_chunk(7, 3, 4))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                              "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_completion_stream_and_full_responses() -> None:
    frame = ResponseFrame("completions", "r2", "tiny", created=5)
    chunk = _data(frame.chunk("a", first=True))
    assert chunk["object"] == "text_completion" and chunk["id"] == "cmpl-r2"
    assert chunk["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    full = frame.response("abc", "stop", 4, 3)
    assert full["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                "finish_reason": "stop"}]  # fmt: skip
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    chat = ResponseFrame("chat", "r3", "tiny", created=5).response("hi", "length", 2, 1)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_wire_messages_round_trip() -> None:
    result = PrefillResult(
        request_id="r", prompt_token_ids=[1, 2, 3], first_token_id=9, first_text="x",
        kv=KVHandle(fingerprint="f", block_size=2, num_tokens=3, keys=["k0", "k1:partial:1"]),
    )  # fmt: skip
    assert PrefillResult.model_validate_json(result.model_dump_json()) == result
    event = DecodeEvent(token_ids=[4], text="y", num_output_tokens=2)
    assert DecodeEvent.model_validate(event.model_dump()) == event


def test_logprobs_in_both_shapes_streamed_and_whole() -> None:
    entries = [
        TokenLogprob(token="He", logprob=-0.5, bytes=[72, 101],
                     top_logprobs=[TopLogprob(token="He", logprob=-0.5, bytes=[72, 101]),
                                   TopLogprob(token="A", logprob=-1.5, bytes=[65])]),
        TokenLogprob(token="llo", logprob=-2.0, bytes=[108, 108, 111],
                     top_logprobs=[TopLogprob(token="y", logprob=-1.0, bytes=[121])]),
    ]  # fmt: skip
    chat = ResponseFrame("chat", "r1", "tiny", created=5)
    chunk = json.loads(chat.chunk("Hello", logprobs=entries)[len(b"data: ") :])
    assert chunk["choices"][0]["logprobs"] == {"content": [e.model_dump() for e in entries]}
    whole = chat.response("Hello", "stop", 3, 2, entries)
    assert whole["choices"][0]["logprobs"]["content"][1]["token"] == "llo"
    completion = ResponseFrame("completions", "r1", "tiny", created=5)
    chunk = json.loads(completion.chunk("llo", logprobs=entries[1:], text_offset=2)[6:])
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["llo"], "token_logprobs": [-2.0],
        "top_logprobs": [{"y": -1.0, "llo": -2.0}], "text_offset": [2],
    }  # fmt: skip
    whole = completion.response("Hello", "length", 3, 2, entries)
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["He", "llo"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"He": -0.5, "A": -1.5}, {"y": -1.0, "llo": -2.0}],
        "text_offset": [0, 2],
    }  # fmt: skip
    # asked for none: null, as before
    assert completion.response("Hello", "length", 3, 2)["choices"][0]["logprobs"] is None
