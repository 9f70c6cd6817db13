"""pdrouter.wire.openai: request parsing, the errors it names, and the response shapes."""

from __future__ import annotations

import json

import pytest

from pdrouter.wire.errors import error_body
from pdrouter.wire.openai import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    UsageInfo,
    parse_request,
)
from tests.pdrouter.wire.request_bodies import chat_body, completion_body, refused


def test_chat_request_defaults_and_extensions() -> None:
    req = parse_request(
        ChatCompletionRequest,
        chat_body(top_k=5, stop_token_ids=[7, 9], ignore_eos=True, stop="x", some_new_field=1),
    )
    assert req.model == "tiny"
    assert req.message_dicts() == [{"role": "user", "content": "hi"}]
    assert (req.top_k, req.stop_token_ids, req.ignore_eos) == (5, [7, 9], True)
    assert req.stop_strings() == ("x",)
    assert (req.temperature, req.top_p, req.seed, req.stream) == (None, None, None, False)
    assert req.requested_max_tokens() is None
    assert not req.include_usage_in_stream()


def test_chat_text_parts_are_joined_and_developer_is_system() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    req = parse_request(ChatCompletionRequest, chat_body(messages=messages))
    assert req.message_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_request(ChatCompletionRequest, chat_body(max_tokens=9, max_completion_tokens=4))
    assert req.requested_max_tokens() == 4


def test_stream_options_include_usage() -> None:
    req = parse_request(
        CompletionRequest, completion_body(stream=True, stream_options={"include_usage": True})
    )
    assert req.include_usage_in_stream()


def test_seeds_any_signed_64_bit_and_minus_one_is_unseeded() -> None:
    assert parse_request(CompletionRequest, completion_body(seed=-1)).seed is None
    assert parse_request(CompletionRequest, completion_body(seed=-(2**63))).seed == -(2**63)
    assert parse_request(CompletionRequest, completion_body(seed=2**64 - 1)).seed == 2**64 - 1


def test_batched_prompts() -> None:
    req = parse_request(CompletionRequest, completion_body(prompt=["a", "b"]))
    assert req.prompts() == ["a", "b"]
    assert parse_request(CompletionRequest, completion_body(prompt=[[1], [2, 3]])).prompts() == [
        [1],
        [2, 3],
    ]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", "abc"), ([1, 2, 3], [1, 2, 3]), (["abc"], "abc"), ([[4, 5]], [4, 5])],
)
def test_completion_single_prompt_shapes(prompt: object, expected: object) -> None:
    assert (
        parse_request(CompletionRequest, completion_body(prompt=prompt)).single_prompt() == expected
    )


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (completion_body(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
        (completion_body(max_tokens="5"), "max_tokens", "valid integer"),
        (completion_body(max_tokens=2.5), "max_tokens", "valid integer"),
        (completion_body(temperature=2.5), "temperature", "less than or equal to 2"),
        (completion_body(temperature="hot"), "temperature", "valid number"),
        (completion_body(top_p=0), "top_p", "greater than 0"),
        (completion_body(top_k=-2), "top_k", "greater than or equal to -1"),
        (completion_body(stream="yes"), "stream", "valid boolean"),
        (
            completion_body(seed=-(2**63) - 1),
            "seed",
            "greater than or equal to -9223372036854775808",
        ),
        (completion_body(seed=2**64), "seed", "less than 18446744073709551616"),
        (completion_body(n=0), "n", "greater than or equal to 1"),
        (completion_body(n=17), "n", "less than or equal to 16"),
        (completion_body(stop=""), "stop", "non-empty"),
        (completion_body(stop_token_ids=[-1]), "stop_token_ids", "non-negative"),
        (
            completion_body(stop_token_ids=[7] * 1025),
            "stop_token_ids",
            "at most 1024 stop_token_ids (got 1025)",
        ),
        (completion_body(prompt=5), "prompt", "valid string"),
        (completion_body(prompt=["a"] * 65), "prompt", "at most 64 sequences per request"),
        (completion_body(echo="yes"), "echo", "valid boolean"),
        (completion_body(logprobs=21), "logprobs", "less than or equal to 20"),
        (completion_body(best_of=1, n=2), "best_of", "best_of (1) must be at least n (2)"),
        (completion_body(best_of=3, stream=True), "best_of", "cannot be streamed"),
        (
            completion_body(stream_options={"include_usage": True}),
            "stream_options",
            "stream is true",
        ),
        (json.dumps({"prompt": "x"}).encode(), "model", "Field required"),
    ],
)
def test_completion_refusals_name_the_field(body: bytes, param: str | None, fragment: str) -> None:
    err = refused(CompletionRequest, body)
    assert err.param == param
    assert fragment in err.message


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat_body(messages=[]), "messages", "at least 1 item"),
        (
            chat_body(messages=[{"role": "function", "content": "x"}]),
            "messages[0].role",
            "'system'",
        ),
        (chat_body(messages=[{"content": "x"}]), "messages[0].role", "Field required"),
        (
            chat_body(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
            ),
            "messages[0].content",
            "content part 0 has type 'image_url'; only 'text' is supported",
        ),
        (
            chat_body(messages=[{"role": "user", "content": 7}]),
            "messages[0].content",
            "valid string",
        ),
        (chat_body(top_logprobs=3), "top_logprobs", "needs logprobs set to true"),
        (chat_body(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
    ],
)
def test_chat_refusals_name_the_field(body: bytes, param: str, fragment: str) -> None:
    err = refused(ChatCompletionRequest, body)
    assert err.param == param
    assert fragment in err.message


def test_error_body_shape() -> None:
    assert error_body("bad", param="top_p") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}
    }


def test_chat_delta_leaves_out_unset_keys() -> None:
    chunk = ChatCompletionChunk(
        id="chatcmpl-1",
        created=5,
        model="tiny",
        choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason="stop")],
    )
    assert json.loads(chunk.model_dump_json()) == {
        "id": "chatcmpl-1",
        "created": 5,
        "model": "tiny",
        "system_fingerprint": None,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
        "usage": None,
    }
    assert UsageInfo.of(3, 4).model_dump() == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
