"""litellm against the router: one structured answer and one tool call (`make test-litellm`,
which installs litellm in a venv of its own: it is too heavy for make test's, whose run skips
this module)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.pd.test_structured_output import MODEL, QUESTION, WEATHER

litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.slow
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "warm": {"type": "boolean"}},
    "required": ["city", "warm"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def router_url(demo_cluster: Cluster) -> str:
    return demo_cluster.router_url


def _ask(router_url: str, **kwargs):
    return litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{router_url}/v1", api_key="unused",
        messages=QUESTION, temperature=0, max_tokens=100, **kwargs,
    )  # fmt: skip


def test_litellm_structured_answer(router_url: str):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    answer = _ask(router_url, response_format=fmt)
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_litellm_tool_call(router_url: str):
    answer = _ask(router_url, tools=[WEATHER], tool_choice="required")
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
