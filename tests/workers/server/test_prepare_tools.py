"""workers.server.prepare with tools and response formats, on the demo model's tokenizer: a
template that renders tools gets them, one that does not gets them as a system message; the
grammar of a forced call or a schema is compiled once per schema; a bad schema is a 400."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ChatCompletionRequest, parse_request
from workers.engine.grammar import Grammars
from workers.engine.grammar_compiler import GrammarCounts
from workers.engine.tokenizer import Tokenizer
from workers.models.packaged import packaged_model_dir
from workers.server.prepare import prepare_request
from workers.server.structured import with_grammar

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
# The shape of Qwen2's template, cut down: tools in a system block, calls as <tool_call> text.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}<|assistant|>\n"
)


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(packaged_model_dir("demo"))


def _prompt(tokenizer: Tokenizer, **body: object) -> str:
    request = parse_request(ChatCompletionRequest, json.dumps({"model": "demo", **body}).encode())
    prepared = prepare_request(request, "r", tokenizer, 512)
    return tokenizer.decode(list(prepared.prompt_token_ids), skip_special_tokens=False)


def test_a_template_without_tools_gets_them_as_a_system_message(demo_tokenizer: Tokenizer):
    assert not demo_tokenizer.renders_tools
    text = _prompt(demo_tokenizer, messages=[{"role": "user", "content": "Oslo?"}],
                   tools=[WEATHER])  # fmt: skip
    assert text.startswith("<|bos|><|system|>\nYou may call one or more functions")
    assert json.dumps(WEATHER) in text
    none = _prompt(demo_tokenizer, messages=[{"role": "user", "content": "Oslo?"}],
                   tools=[WEATHER], tool_choice="none")  # fmt: skip
    assert "<tools>" not in none


def test_a_template_with_tools_renders_them_and_earlier_calls(demo_tokenizer: Tokenizer):
    tokenizer = Tokenizer(demo_tokenizer._backend, TOOLS_TEMPLATE, eos_token_ids=(1,))
    assert tokenizer.renders_tools
    call = {"id": "c", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "sunny"}]  # fmt: skip
    text = _prompt(tokenizer, messages=messages, tools=[WEATHER])
    assert text.startswith("<|system|>\n# Tools\n" + json.dumps(WEATHER))
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|tool|>\nsunny<|end|>" in text


def test_grammars_of_schemas_and_forced_calls(demo_tokenizer: Tokenizer):
    grammars = Grammars(demo_tokenizer, demo_tokenizer.vocab_size)

    def grammar(**body: object) -> str | None:
        body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], **body}
        request = parse_request(ChatCompletionRequest, json.dumps(body).encode())
        prepared = prepare_request(request, "r", demo_tokenizer, 512)
        assert prepared.params.grammar is None  # compiled only by with_grammar, awaited
        return asyncio.run(with_grammar(prepared.params, prepared.constraint, grammars)).grammar

    try:
        assert grammar() is None
        assert grammar(tools=[WEATHER]) is None  # auto: free text
        named = {"type": "function", "function": {"name": "weather"}}
        assert grammar(tools=[WEATHER], tool_choice=named) is not None
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
        assert grammar(response_format=fmt) == grammar(response_format={"type": "json_object"})
        # the named call and {"type":"object"} compiled; json_object's same schema: the cache
        assert grammars.counts() == GrammarCounts(compiled=2, cache_hit=1)
        bad = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}
        with pytest.raises(APIError) as info:
            grammar(response_format=bad)
        assert info.value.status == 400
        assert info.value.param == "response_format.json_schema.schema"
    finally:
        grammars.close()
