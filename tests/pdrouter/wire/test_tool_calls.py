"""Structured output and tools on the wire: what each request must be constrained to, tool
calls read back from the model families' formats, and the answers' OpenAI shapes (whole and
streamed, the stream's deltas adding up to the whole answer)."""

from __future__ import annotations

import json

import pytest

from pdrouter.wire.openai import ChatCompletionRequest, ProtocolError, parse_request
from pdrouter.wire.responses import ResponseFrame
from pdrouter.wire.structured import output_constraint
from pdrouter.wire.tool_calls import parse_tool_calls, with_tools_in_text
from pdrouter.wire.tool_stream import chat_frame, tool_answer
from tests.pdrouter.wire.request_bodies import chat_body

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "time"}}


def _chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, chat_body(**fields))


def _schema(**fields) -> dict | None:
    request = _chat(**fields)
    constraint = output_constraint(request.response_format, request)
    return None if constraint is None else json.loads(constraint.schema_json)


def test_what_each_request_is_constrained_to():
    user_schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": user_schema}}
    assert _schema(response_format=json_schema) == user_schema
    assert list(_schema(response_format=json_schema)["properties"]) == ["b", "a"]  # order kept
    assert _schema(response_format={"type": "json_object"}) == {"type": "object"}
    assert _schema(response_format={"type": "text"}) is None
    named = {"type": "function", "function": {"name": "weather"}}
    assert _schema(tools=[WEATHER, TIME], tool_choice=named) == WEATHER["function"]["parameters"]
    required = _schema(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert (required["type"], required["minItems"], required["maxItems"]) == ("array", 1, 1)
    time_call = required["items"]["anyOf"][1]
    assert time_call["properties"]["name"] == {"const": "time"}
    assert time_call["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in _schema(tools=[WEATHER], tool_choice="required")
    assert _schema(tools=[WEATHER]) is None  # auto: free text, parsed afterwards
    assert _schema(tools=[WEATHER], tool_choice="none") is None


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "names function 'x', which is not in tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct function names"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", "pattern"),
    ],
)  # fmt: skip
def test_bad_structured_requests_name_the_field(fields, param, fragment):
    with pytest.raises(ProtocolError) as info:
        _chat(**fields)
    assert info.value.param == param
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Hermes (Qwen2, and the system-prompt fallback): content before the tags kept.
        ('Let me see.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>',
         "Let me see.", [("weather", {"city": "Oslo"}), ("time", {})]),
        # Llama 3: the answer is one JSON call with "parameters".
        ('{"name": "weather", "parameters": {"city": "Rome"}}', None,
         [("weather", {"city": "Rome"})]),
        # Mistral: a list, its [TOOL_CALLS] marker kept or dropped by the detokenizer.
        ('[TOOL_CALLS] [{"name": "time", "arguments": {}}]', None, [("time", {})]),
        ("It is sunny.", "It is sunny.", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
        ("<tool_call>{broken", "<tool_call>{broken", []),
    ],
)  # fmt: skip
def test_auto_tool_calls_parse_from_the_families_formats(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, "auto")
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in got_calls)


def _sse_payloads(data: bytes) -> list[dict]:
    return [
        json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")
    ]


def _stream(frame: ResponseFrame, deltas: list[str], finish: str = "stop") -> list[dict]:
    out = frame.chunk(deltas[0], first=True)
    for delta in deltas[1:]:
        out += frame.chunk(delta)
    out += frame.chunk("", finish)
    return _sse_payloads(out)


def _collect(payloads: list[dict]) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls and finish, accumulated as OpenAI's clients do: a call's first delta
    has its id, type and name, later ones of its index add to its arguments."""
    content, calls, finish = "", [], None
    for payload in payloads:
        choice = payload["choices"][0]
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls") or ():
            if call["index"] == len(calls):
                assert call["type"] == "function" and call["id"].startswith("call_")
                calls.append((call["function"]["name"], call["function"]["arguments"]))
            else:
                assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
                name, arguments = calls[-1]
                calls[-1] = (name, arguments + call["function"]["arguments"])
        finish = choice["finish_reason"] or finish
    return content, calls, finish


def _frame(**fields) -> ResponseFrame:
    return chat_frame(ResponseFrame("chat", "r1", "m", created=1), *tool_answer(_chat(**fields)))


def test_streamed_tool_calls_add_up_to_the_whole_answer():
    text = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    deltas = ["Sure.", "<tool", "_call>", '{"name": "weather", ', '"arguments": {"city": "Oslo"}}',
              "</tool_call>"]  # fmt: skip
    assert "".join(deltas) == text
    content, calls, finish = _collect(_stream(_frame(tools=[WEATHER]), deltas))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert calls == [("weather", '{"city": "Oslo"}')]
    whole = _frame(tools=[WEATHER]).response(text, "stop", 3, 9)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == (
        calls
    )
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_text_that_calls_nothing_streams_as_content():
    deltas = ["The answer", " is <b", ">42</b>", " or {1}."]
    content, calls, finish = _collect(_stream(_frame(tools=[WEATHER]), deltas))
    assert (content, calls, finish) == ("".join(deltas), [], "stop")
    # Held only while it may begin a call: "The answer" leaves at once.
    first_content = _stream(_frame(tools=[WEATHER]), deltas)[1]["choices"][0]["delta"]
    assert first_content == {"content": "The answer"}


def test_named_and_required_answers_are_calls():
    named = {"type": "function", "function": {"name": "weather"}}
    content, calls, finish = _collect(
        _stream(_frame(tools=[WEATHER], tool_choice=named), ['{"city":', '"Oslo"}'])
    )
    assert (content, calls, finish) == ("", [("weather", '{"city":"Oslo"}')], "tool_calls")
    answer = '[{"name":"time","parameters":{}},{"name":"weather","parameters":{"city":"A"}}]'
    frame = _frame(tools=[WEATHER, TIME], tool_choice="required")
    message = frame.response(answer, "stop", 1, 1)["choices"][0]["message"]
    assert message["content"] is None
    # the arguments as the model wrote them: what a stream of the answer adds up to
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}", '{"city":"A"}']
    # Cut short: the finish stays "length".
    cut = _frame(tools=[WEATHER], tool_choice=named).response('{"ci', "length", 1, 1)
    assert cut["choices"][0]["finish_reason"] == "length"


def _tool_deltas(payloads: list[dict]) -> list[dict]:
    return [d for p in payloads for d in p["choices"][0]["delta"].get("tool_calls") or ()]


def test_forced_calls_stream_their_arguments_as_they_are_written():
    named = {"type": "function", "function": {"name": "weather"}}
    payloads = _stream(_frame(tools=[WEATHER], tool_choice=named), ['{"ci', 'ty":"Os', 'lo"}'])
    deltas = _tool_deltas(payloads)
    assert [d["function"]["arguments"] for d in deltas] == ["", '{"ci', 'ty":"Os', 'lo"}']
    assert (deltas[0]["function"]["name"], deltas[0]["type"]) == ("weather", "function")
    answer = '[{"name":"time","parameters":{}},{"name":"weather","parameters":{"city":"A,}"}}]'
    pieces = [answer[i : i + 5] for i in range(0, len(answer), 5)]
    frame = _frame(tools=[WEATHER, TIME], tool_choice="required")
    payloads = _stream(frame, pieces)
    deltas = _tool_deltas(payloads)
    starts = [(d["index"], d["function"]["name"]) for d in deltas if "id" in d]
    assert starts == [(0, "time"), (1, "weather")]
    assert len([d for d in deltas if d["index"] == 1]) > 2  # the arguments in several pieces
    content, calls, finish = _collect(payloads)
    whole = _frame(tools=[WEATHER, TIME], tool_choice="required").response(answer, "stop", 1, 1)
    message = whole["choices"][0]["message"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in message["tool_calls"]]  # fmt: skip
    assert calls == [("time", "{}"), ("weather", '{"city":"A,}"}')]
    assert (content, finish) == ("", "tool_calls")
    # Cut before any call began: what was written comes back as content.
    cut = _collect(_stream(_frame(tools=[WEATHER], tool_choice="required"), ['[{"na']))
    assert cut == ('[{"na', [], "stop")


@pytest.mark.parametrize(
    ("calls_text", "expected"),
    [
        ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo, \\"N\\"}"}}\n'
         '</tool_call>\n<tool_call>{"arguments": {"tz" : "CET"} , "name": "time"}</tool_call>',
         [("weather", '{"city": "Oslo, \\"N\\"}"}'), ("time", '{"tz" : "CET"}')]),
        # arguments as a JSON string: its value; no arguments: {}
        ('<tool_call>{"name": "weather", "arguments": "{\\"city\\": 1}"}</tool_call>'
         '<tool_call>{"name": "time"}</tool_call>',
         [("weather", '{"city": 1}'), ("time", "{}")]),
    ],
)  # fmt: skip
def test_auto_hermes_calls_stream_as_they_are_written(calls_text, expected):
    text = "Let me look." + calls_text
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    payloads = _stream(_frame(tools=[WEATHER, TIME]), pieces)
    deltas = _tool_deltas(payloads)
    assert [d["function"]["name"] for d in deltas if "id" in d] == [n for n, _ in expected]
    first_call = next(
        i for i, p in enumerate(payloads) if p["choices"][0]["delta"].get("tool_calls")
    )
    assert first_call < len(payloads) - 3  # the calls came while the text came, not at the end
    content, calls, finish = _collect(payloads)
    assert (content, calls, finish) == ("Let me look.", expected, "tool_calls")
    whole = _frame(tools=[WEATHER, TIME]).response(text, "stop", 1, 1)["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == (
        expected
    )
    assert whole["content"] == "Let me look."


def test_plain_requests_keep_the_plain_frame():
    frame = ResponseFrame("chat", "r1", "m", created=1)
    assert chat_frame(frame, *tool_answer(_chat())) is frame
    assert chat_frame(frame, *tool_answer(_chat(tools=[WEATHER], tool_choice="none"))) is frame


def test_templates_without_tools_get_them_as_text():
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    history = _chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        tools=[WEATHER],
    )
    messages = history.message_dicts()
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    as_text = with_tools_in_text(messages, history.rendered_tools())
    assert as_text[0]["role"] == "system" and as_text[0]["content"].startswith("Be brief.")
    assert '"name": "weather"' in as_text[0]["content"]
    assert as_text[2]["content"] == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert as_text[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
