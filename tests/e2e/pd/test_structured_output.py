"""Structured output and tools through PD and on a mixed worker, with the real clients.

The demo model writes prose on its own; only the grammar makes its answers JSON. Through P
(the first token, masked there) and D (the grammar replayed from P's token, then masked per
step), every answer is valid against its schema (jsonschema), streamed or not, and equal to
the mixed worker's token for token (greedy); a D taking over mid-answer (the tokens the client
has, replayed into the matcher at admission) ends the same answer. Tools: a named or required
choice always returns calls whose arguments match the function's parameters; the stream's
tool_calls deltas add up to the whole answer; a conversation with an assistant's call and the
tool's answer is served; langchain-openai's with_structured_output and bind_tools work
against the router.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from benchmarks.structured import varied_schemas
from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.launch.cluster import Cluster
from pdrouter.wire.pd import DecodeEvent, DecodeRequest, PrefillRequest, PrefillResult
from tests.e2e.pd.clients import client
from tests.sse import sse_data

pytestmark = pytest.mark.slow
MODEL = "demo"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def cluster(demo_cluster: Cluster) -> Cluster:
    return demo_cluster


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}


def _content(api: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish_reason) of a chat answer, streamed or not."""
    kwargs = {"model": MODEL, "messages": QUESTION, "temperature": 0, **kwargs}
    if not stream:
        r = api.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    texts, finish = [], None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(texts), finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_varied_schemas_valid_through_pd_and_equal_to_mixed(cluster: Cluster, stream: bool):
    router, mixed = client(cluster.router_url), client(cluster.mixed_urls[0])
    for schema in varied_schemas(4, seed=1 if stream else 2):
        fmt = _schema_format(schema)
        text, finish = _content(router, stream, response_format=fmt, max_tokens=160)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert _content(mixed, stream, response_format=fmt, max_tokens=160) == (text, finish)


def test_json_object_and_seeded_sampling(cluster: Cluster):
    api = client(cluster.router_url)
    schema = varied_schemas(1, seed=3)[0]
    for seed in (1, 2):
        kwargs = {"response_format": _schema_format(schema), "temperature": 1.0, "seed": seed}
        text, finish = _content(api, False, max_tokens=160, **kwargs)
        jsonschema.validate(json.loads(text), schema)
        assert _content(client(cluster.mixed_urls[0]), False, max_tokens=160, **kwargs) == (
            text,
            finish,
        )
    text, finish = _content(api, True, response_format={"type": "json_object"}, max_tokens=200)
    if finish == "stop":  # an open object may run past max_tokens; the API then cuts it
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_a_schema_that_cannot_compile_is_a_400_naming_it(cluster: Cluster):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    for url in (cluster.router_url, cluster.mixed_urls[0]):
        with pytest.raises(openai.BadRequestError) as info:
            _content(client(url), False, response_format=_schema_format(bad), max_tokens=8)
        error = info.value.body
        assert error["param"] == "response_format.json_schema.schema", error
        assert "cannot be compiled into a grammar" in error["message"]


def _calls(api: openai.OpenAI, stream: bool, **kwargs) -> tuple[list[tuple[str, str]], str]:
    """[(name, arguments)] and the finish reason, streamed deltas accumulated as the SDK does."""
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 120, "tools": [WEATHER], **kwargs}
    kwargs.setdefault("messages", QUESTION)
    if not stream:
        r = api.chat.completions.create(**kwargs)
        calls = r.choices[0].message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], r.choices[0].finish_reason
    by_index: dict[int, list[str]] = {}
    finish = None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = by_index.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(by_index[i]) for i in sorted(by_index)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_are_valid_through_pd(cluster: Cluster, stream: bool, tool_choice):
    api = client(cluster.router_url)
    calls, finish = _calls(api, stream, tool_choice=tool_choice, parallel_tool_calls=False)
    assert finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    mixed = _calls(client(cluster.mixed_urls[0]), stream, tool_choice=tool_choice,
                   parallel_tool_calls=False)  # fmt: skip
    assert mixed == (calls, finish)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_call_arguments_arrive_in_pieces_the_sdk_adds_up(cluster: Cluster, tool_choice):
    # The calls of a stream came in one chunk at the end; now as the model writes them.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    kwargs = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 120,
              "tools": [strict], "tool_choice": tool_choice,
              "parallel_tool_calls": False}  # fmt: skip
    for url in (cluster.router_url, cluster.mixed_urls[0]):
        api = client(url)
        whole = api.chat.completions.create(**kwargs).choices[0]
        with api.chat.completions.stream(**kwargs) as stream:
            pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion().choices[0]
        assert len({e.arguments_delta for e in pieces}) > 1, pieces  # not one chunk
        streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
        assert streamed == [(c.function.name, c.function.arguments)
                            for c in whole.message.tool_calls]  # fmt: skip
        assert (final.finish_reason, whole.finish_reason) == ("tool_calls", "tool_calls")
        assert final.message.tool_calls[0].function.parsed_arguments == json.loads(streamed[0][1])


def test_a_conversation_with_a_tool_answer(cluster: Cluster):
    arguments = '{"city":"Oslo","unit":"c"}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]  # fmt: skip
    for url in (cluster.router_url, cluster.mixed_urls[0]):
        r = client(url).chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=8
        )
        # auto: the demo model answers in prose, which stays the content.
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content
        assert r.usage.completion_tokens == 8


def test_langchain_structured_output_and_bind_tools(cluster: Cluster):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)

    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{cluster.router_url}/v1", api_key="unused", temperature=0,
        max_tokens=100, max_retries=0,
    )  # fmt: skip
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    message = llm.bind_tools([WEATHER], tool_choice="any").invoke("Weather in Oslo?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def _decode_tokens(cluster: Cluster, req: DecodeRequest) -> tuple[httpx.Response, list[int]]:
    """D's answer to req and the tokens its events carry (none unless it answered 200)."""
    secret = {INTERNAL_SECRET_HEADER: cluster.internal_secret}
    url = f"{cluster.decode_urls[0]}/internal/decode"
    resp = httpx.post(url, json=req.model_dump(), timeout=60, headers=secret)
    if resp.status_code != 200:
        return resp, []
    events = [DecodeEvent.model_validate_json(data) for data in sse_data(resp)]
    assert events[-1].finish_reason == "stop"
    return resp, [t for e in events for t in e.token_ids]


def test_a_d_taking_over_mid_answer_resumes_the_grammar(cluster: Cluster):
    # What the router sends a second D when the first died mid-stream: every token the client
    # has. D builds the matcher at admission, replaying them, and ends the same answer.
    schema = varied_schemas(3)[2]
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 120,
            "response_format": _schema_format(schema)}  # fmt: skip
    secret = {INTERNAL_SECRET_HEADER: cluster.internal_secret}
    prefill = PrefillRequest(request_id="grammar-resume", endpoint="chat", body=body)
    resp = httpx.post(f"{cluster.prefill_urls[0]}/internal/prefill", json=prefill.model_dump(),
                      timeout=60, headers={"X-Request-Id": "grammar-resume", **secret})  # fmt: skip
    assert resp.status_code == 200, resp.text
    first = PrefillResult.model_validate(resp.json())

    def resume(request_id: str, given: list[int]) -> DecodeRequest:
        return DecodeRequest(request_id=request_id, endpoint="chat", body=body,
                             prompt_token_ids=first.prompt_token_ids,
                             output_token_ids=given)  # fmt: skip

    _, rest = _decode_tokens(cluster, resume("grammar-whole", [first.first_token_id]))
    answer = [first.first_token_id, *rest]
    assert len(answer) > 8
    _, tail = _decode_tokens(cluster, resume("grammar-tail", answer[:7]))
    assert tail == answer[7:]
    mixed = cluster.mixed_urls[0]
    # (the last token is the end of sequence the grammar allows once complete)
    text = httpx.post(f"{mixed}/detokenize", json={"model": MODEL, "tokens": answer[:-1]})
    jsonschema.validate(json.loads(text.json()["prompt"]), schema)
    # Tokens the grammar cannot have produced: a 400 naming them.
    prose = httpx.post(f"{mixed}/tokenize", json={"model": MODEL, "prompt": "Hi"})
    bad, _ = _decode_tokens(cluster, resume("grammar-bad", prose.json()["tokens"]))
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "output_token_ids"
