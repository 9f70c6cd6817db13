"""The Responses API's translation (pdrouter.wire.responses_api, responses_output), without a
server: requests to chat bodies (text and tool turns), chat answers and chunks back to
Responses, every object and event validated against the openai SDK's own types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdrouter.common.responses_route import responses_param
from pdrouter.wire.openai import ChatCompletionRequest, parse_request
from pdrouter.wire.protocol_error import ProtocolError
from pdrouter.wire.responses_api import parse_responses_request, to_chat_body
from pdrouter.wire.responses_output import ResponseEvents, response_from_chat

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 4},
}
RESPONSES_USAGE = {
    "input_tokens": 7,
    "output_tokens": 3,
    "total_tokens": 10,
    "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
    "output_tokens_details": {"reasoning_tokens": 0},
}


def parse(**body: object):
    return parse_responses_request(json.dumps({"model": "tiny", **body}).encode())


def test_a_text_turn_is_the_chat_request_of_its_messages() -> None:
    request = parse(
        input="hi",
        instructions="be brief",
        max_output_tokens=5,
        temperature=0,
        top_p=0.5,
        seed=3,
        top_k=4,
        presence_penalty=0.5,
        metadata={"k": "v"},
    )
    assert to_chat_body(request) == {
        "model": "tiny",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 3,
        "top_k": 4,
        "presence_penalty": 0.5,
    }
    streamed = to_chat_body(parse(input="hi", stream=True))
    assert (streamed["stream"], streamed["stream_options"]) == (True, {"include_usage": True})
    # the chat parser takes every body this produces
    parse_request(ChatCompletionRequest, json.dumps(to_chat_body(request)).encode())


def test_input_items_become_messages_and_tool_turns() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "2"}],
        },
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "done", "annotations": []}],
        },
    ]
    tools = [
        {
            "type": "function",
            "name": "f",
            "description": "d",
            "strict": True,
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        }
    ]
    body = to_chat_body(
        parse(
            input=items,
            tools=tools,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "name": "f"},
        )
    )
    assert body["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "strict": True,
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    schema = {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}
    assert to_chat_body(parse(input="x", text={"format": schema}))["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_responses_request(json.dumps({"model": "tiny", **body}).encode())
        to_chat_body(parse(**body))
    assert info.value.param == param


def test_noop_values_of_refused_parameters_pass() -> None:
    parse(
        input="x",
        reasoning={},
        background=False,
        truncation="disabled",
        store=True,
        include=[],
        top_logprobs=0,
        previous_response_id=None,
    )


def test_a_chat_answer_is_a_response() -> None:
    request = parse(input="hi", max_output_tokens=3)
    chat = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hey"},
                "finish_reason": "length",
            }
        ],
        "usage": USAGE,
    }
    response = response_from_chat(chat, request, "resp_ab", 12.0)
    Response.model_validate(response)
    assert (response["status"], response["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert response["output"] == [
        {
            "id": "msg_ab",
            "type": "message",
            "status": "incomplete",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hey", "annotations": [], "logprobs": []}],
        }
    ]
    assert response["usage"] == RESPONSES_USAGE


def test_chat_tool_calls_are_function_call_items() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    chat = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": None, "tool_calls": calls},
            }
        ],
        "usage": USAGE,
    }
    response = response_from_chat(chat, parse(input="x"), "resp_ab", 1.0)
    Response.model_validate(response)
    assert response["status"] == "completed"
    assert response["output"] == [
        {
            "id": "fc_call_1",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "f",
            "arguments": "{}",
        }
    ]


def events_of(stream: bytes) -> list[dict]:
    events = []
    for block in stream.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT.validate_python(event)  # the SDK's own shape
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_streamed_text_answer_has_the_responses_events() -> None:
    events = ResponseEvents(parse(input="hi", stream=True), "resp_ab")
    stream = (
        events.start()
        + events.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + events.chunk({"choices": [{"index": 0, "delta": {"content": "He"}}]})
        + events.chunk(
            {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}]}
        )
        + events.chunk({"choices": [], "usage": USAGE})
        + events.finish()
    )
    got = events_of(stream)
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in got if e["type"] == "response.output_text.delta"] == ["He", "y"]
    assert got[6]["text"] == "Hey"
    final = got[-1]["response"]
    assert (final["status"], final["usage"]) == ("completed", RESPONSES_USAGE)
    assert final["output"][0]["content"][0]["text"] == "Hey"


def test_streamed_tool_calls_and_an_empty_or_failed_stream() -> None:
    events = ResponseEvents(parse(input="x", stream=True), "resp_ab")
    first = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    stream = (
        events.start()
        + events.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]})
        + events.chunk(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
                    }
                ]
            }
        )
        + events.chunk(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                        "finish_reason": "tool_calls",
                    }
                ]
            }
        )
        + events.finish()
    )
    got = events_of(stream)
    assert [e["type"] for e in got][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert got[-2]["item"]["arguments"] == '{"a":1}'

    empty = ResponseEvents(parse(input="x", stream=True), "resp_cd")
    got = events_of(empty.start() + empty.finish())
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == ""
    failed = ResponseEvents(parse(input="x", stream=True), "resp_ef")
    error = {"message": "decode failed", "type": "server_error", "param": None, "code": None}
    got = events_of(failed.start() + failed.error(error))
    assert got[-1] == {
        "type": "error",
        "sequence_number": 2,
        "code": None,
        "message": "decode failed",
        "param": None,
    }


def test_chat_param_names_are_given_back_as_the_responses_request_names_them() -> None:
    assert [
        responses_param(p)
        for p in ("messages", "messages[2].content", "max_completion_tokens", "temperature", None)
    ] == ["input", "input", "max_output_tokens", "temperature", None]


LOGPROBS = "message.output_text.logprobs"


def _entry(token: str, logprob: float, *top: tuple[str, float]) -> dict:
    """A chat logprobs.content entry, as the chat route writes it."""

    def one(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


def test_output_logprobs_are_asked_of_chat_only_with_the_include() -> None:
    body = to_chat_body(parse(input="x", include=[LOGPROBS], top_logprobs=3))
    assert (body["logprobs"], body["top_logprobs"]) == (True, 3)
    body = to_chat_body(parse(input="x", include=["reasoning.encrypted_content", LOGPROBS]))
    assert (body["logprobs"], body["top_logprobs"]) == (True, 0)
    # top_logprobs alone asks for nothing (as vLLM), and is echoed in the Response
    body = to_chat_body(parse(input="x", top_logprobs=3))
    assert "logprobs" not in body and "top_logprobs" not in body
    parse_request(ChatCompletionRequest, json.dumps(body).encode())


def test_a_chat_answer_with_logprobs_has_them_on_its_output_text() -> None:
    request = parse(input="hi", include=[LOGPROBS], top_logprobs=1)
    entries = [_entry("He", -0.5, ("He", -0.5)), _entry("y", -1.25, ("!", -0.75))]
    chat = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hey"},
                "logprobs": {"content": entries},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    response = response_from_chat(chat, request, "resp_ab", 1.0)
    Response.model_validate(response)
    assert response["top_logprobs"] == 1
    part = response["output"][0]["content"][0]
    assert part["logprobs"] == [
        {
            "token": "He",
            "bytes": [72, 101],
            "logprob": -0.5,
            "top_logprobs": [{"token": "He", "bytes": [72, 101], "logprob": -0.5}],
        },
        {
            "token": "y",
            "bytes": [121],
            "logprob": -1.25,
            "top_logprobs": [{"token": "!", "bytes": [33], "logprob": -0.75}],
        },
    ]


def test_streamed_logprobs_ride_on_the_text_deltas() -> None:
    events = ResponseEvents(parse(input="hi", stream=True, include=[LOGPROBS]), "resp_ab")
    he, held, y = _entry("He", -0.5), _entry("\u00e9", -2.0), _entry("y", -1.25, ("!", -0.75))

    def chunk(content: str, *entries: dict, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
        return {"choices": [{**choice, "logprobs": {"content": list(entries)}}]}

    stream = (
        events.start()
        + events.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + events.chunk(chunk("He", he))
        + events.chunk(chunk("", held))  # a token whose text is still held back
        + events.chunk(chunk("y", y, finish="stop"))
        + events.finish()
    )
    got = events_of(stream)
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert [(e["delta"], e["logprobs"]) for e in deltas] == [
        ("He", [{"token": "He", "logprob": -0.5, "top_logprobs": []}]),
        ("", [{"token": "\u00e9", "logprob": -2.0, "top_logprobs": []}]),
        (
            "y",
            [{"token": "y", "logprob": -1.25, "top_logprobs": [{"token": "!", "logprob": -0.75}]}],
        ),
    ]
    done = next(e for e in got if e["type"] == "response.output_text.done")
    assert done["logprobs"] == [lp for e in deltas for lp in e["logprobs"]]
    final = got[-1]["response"]
    assert [lp["token"] for lp in final["output"][0]["content"][0]["logprobs"]] == [
        "He",
        "\u00e9",
        "y",
    ]
    part_done = next(e for e in got if e["type"] == "response.content_part.done")
    assert part_done["part"] == final["output"][0]["content"][0]
