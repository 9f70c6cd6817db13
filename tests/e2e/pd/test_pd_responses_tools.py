"""Tool-call turns of the Responses API through PD and on the mixed worker (the demo model,
whose calls only the grammar makes valid): a forced function call comes back as a
function_call item, streamed (function_call_arguments events) or not, equal through PD and
mixed; the next turn sends the call and its output back as input items and gets text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.pd.clients import client

pytestmark = pytest.mark.slow
MODEL = "demo"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": PARAMETERS,
    "strict": True,
}
QUESTION = "What is the weather in Oslo?"
FORCED = {
    "model": MODEL,
    "input": QUESTION,
    "tools": [WEATHER],
    "temperature": 0,
    "max_output_tokens": 120,
    "parallel_tool_calls": False,
    "tool_choice": {"type": "function", "name": "get_weather"},
}


def _call(api: openai.OpenAI, stream: bool) -> tuple[str, str, str]:
    """(name, arguments, status) of the one function_call item of a forced turn."""
    if not stream:
        r = api.responses.create(**FORCED)
        (item,) = r.output
        assert (item.type, item.status) == ("function_call", "completed")
        return item.name, item.arguments, r.status
    events = list(api.responses.create(stream=True, **FORCED))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    (item,) = final.output
    assert deltas == done.arguments == item.arguments
    return item.name, item.arguments, final.status


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_call_is_a_function_call_item_through_pd(demo_cluster: Cluster, stream: bool):
    name, arguments, status = _call(client(demo_cluster.router_url), stream)
    assert (name, status) == ("get_weather", "completed")
    jsonschema.validate(json.loads(arguments), PARAMETERS)
    assert _call(client(demo_cluster.mixed_urls[0]), stream) == (name, arguments, status)


def test_the_call_and_its_output_as_the_next_turns_input(demo_cluster: Cluster):
    items = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Oslo","unit":"c"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "12 degrees"},
    ]
    answers = []
    for url in (demo_cluster.router_url, demo_cluster.mixed_urls[0]):
        r = client(url).responses.create(
            model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=8
        )
        assert [item.type for item in r.output] == ["message"]
        assert r.output_text and r.usage.output_tokens == 8
        answers.append(r.output_text)
    assert answers[0] == answers[1]
