"""The worker's stream and bodies (pdrouter.wire.responses): the bytes OpenAI clients parse."""

from __future__ import annotations

import json

from pdrouter.wire.responses import SSE_DONE, ResponseFrame, sse_error


def _data(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[len(b"data: ") : -2])


def test_chat_stream_sequence() -> None:
    b = ResponseFrame("chat", "abc", "tiny", created=7, system_fingerprint="fp1")
    common = {
        "id": "chatcmpl-abc",
        "created": 7,
        "model": "tiny",
        "system_fingerprint": "fp1",
        "object": "chat.completion.chunk",
    }
    opening = b.chunk("", first=True)
    assert _data(opening) == {
        **common,
        "usage": None,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    assert _data(b.chunk("hé"))["choices"][0]["delta"] == {"content": "hé"}
    final = _data(b.chunk("", "length"))["choices"][0]
    assert (final["delta"], final["finish_reason"]) == ({}, "length")
    assert _data(b.usage_chunk(5, 2)) == {
        **common,
        "choices": [],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_completion_stream_and_full() -> None:
    b = ResponseFrame("completions", "r9", "tiny", created=1)
    chunk = _data(b.chunk("xy"))
    assert (chunk["id"], chunk["object"]) == ("cmpl-r9", "text_completion")
    assert chunk["choices"] == [{"index": 0, "text": "xy", "logprobs": None, "finish_reason": None}]
    full = b.response("xyz", "stop", 4, 3, num_cached_tokens=2)
    assert full["choices"] == [
        {"index": 0, "text": "xyz", "logprobs": None, "finish_reason": "stop"}
    ]
    assert full["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_chat_full_response() -> None:
    full = ResponseFrame("chat", "q", "m", created=2).response("ok", "stop", 1, 1)
    assert full["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert full["object"] == "chat.completion"


def test_in_band_error_event() -> None:
    assert _data(sse_error("boom", code="engine_failed")) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_failed"}
    }
