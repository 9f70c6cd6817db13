"""workers.engine.grammar in the engine: the demo model's answers under a schema are valid
JSON of that schema, greedy and seeded; a request that arrives with its first token (D after
P) continues exactly as the whole request did; the mask never touches the raw logits."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.grammar import GrammarError, compile_json_schema, mask_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    from workers.engine.loader import load_model
    from workers.engine.runner import ModelRunner

    loaded = load_model("demo")
    config = EngineConfig(model="demo", block_size=16, num_kv_blocks=32, max_model_len=512)
    runner = ModelRunner(loaded, 32, 16)
    return LLMEngine(runner, loaded.tokenizer, config, loaded.config.vocab_size, loaded.config)


def _prompt(engine: LLMEngine, question: str) -> tuple[int, ...]:
    tok = engine.tokenizer
    return tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": question}])))


def _run(engine: LLMEngine, request: EngineRequest) -> tuple[list[int], str, str | None]:
    outputs = engine.generate([engine.grammars.ready(request)])[request.request_id]
    tokens = [t for out in outputs for t in out.new_token_ids]
    return tokens, "".join(out.new_text for out in outputs), outputs[-1].finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_follow_the_schema_and_d_continues_from_the_tokens_given(engine, temperature):
    grammar = compile_json_schema(json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=7, grammar=grammar)
    prompt = _prompt(engine, "Describe a pet.")
    tokens, text, finish = _run(engine, EngineRequest(f"whole-{temperature}", prompt, params))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    # D's shape: the first token given (P sampled it); and a D taking over mid-stream, with
    # every token streamed so far. The grammar replays them and goes on.
    for num_given in (1, 6):
        given = tuple(tokens[:num_given])
        request = EngineRequest(
            f"d{num_given}-{temperature}", prompt, params, output_token_ids=given
        )
        rest, _, _ = _run(engine, request)
        assert rest == tokens[num_given:]


def test_unconstrained_answer_is_not_json(engine):
    # The same prompt without a grammar: the demo model writes prose (the mask is what works).
    _, text, _ = _run(
        engine,
        EngineRequest("free", _prompt(engine, "Describe a pet."), SamplingParams(max_tokens=12)),
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_given_outputs_that_break_the_grammar_are_refused(engine):
    grammar = compile_json_schema(json.dumps(SCHEMA))
    not_json = tuple(engine.tokenizer.encode("hello"))
    request = EngineRequest(
        "bad", _prompt(engine, "x"), SamplingParams(grammar=grammar), output_token_ids=not_json
    )
    with pytest.raises(ValueError, match="do not follow the request's grammar"):
        engine.grammars.ready(request)


def test_the_engine_takes_a_constrained_request_only_with_its_matcher(engine):
    # Building a matcher is the server's work (off the engine thread): the engine refuses a
    # constrained request without one rather than stall its step loop building it.
    grammar = compile_json_schema(json.dumps(SCHEMA))
    request = EngineRequest("bare", _prompt(engine, "x"), SamplingParams(grammar=grammar))
    with pytest.raises(ValueError, match="needs its matcher"):
        engine.add_request(request)
    assert "bare" not in engine.scheduler.requests
    ready = engine.grammars.ready(request)
    assert ready.matcher is not None and engine.grammars.ready(ready) is ready
    free = EngineRequest("free", (1,), SamplingParams())
    assert engine.grammars.ready(free) is free


def test_mask_copies_only_constrained_rows(engine):
    grammar = compile_json_schema(json.dumps(SCHEMA))
    matcher = engine.grammars.matcher(grammar)
    logits = np.arange(2 * engine.limits.vocab_size, dtype=np.float32).reshape(2, -1)
    raw = logits.copy()
    masked = mask_logits(logits, [None, matcher])
    np.testing.assert_array_equal(logits, raw)
    np.testing.assert_array_equal(masked[0], raw[0])
    allowed = np.flatnonzero(np.isfinite(masked[1]))
    # An object opens with "{": every allowed first token's text starts with it.
    assert len(allowed) > 0
    assert all(engine.tokenizer.decode([int(t)]).startswith("{") for t in allowed)
    assert mask_logits(logits, [None, None]) is logits
    # Several constrained rows (their masks computed in parallel): each row's own mask.
    other = engine.grammars.matcher(compile_json_schema('{"type":"array"}'))
    same = np.tile(raw[1], (2, 1))
    both = mask_logits(same, [matcher, other])
    np.testing.assert_array_equal(both[0], masked[1])
    np.testing.assert_array_equal(both[1], mask_logits(same[:1], [other])[0])
    assert not np.array_equal(both[0], both[1])


def test_a_schema_llguidance_cannot_compile_says_why():
    with pytest.raises(GrammarError, match="does not exist"):
        compile_json_schema(json.dumps({"properties": {"a": {"$ref": "#/nowhere"}}}))
    assert compile_json_schema('{"type":"object"}') is compile_json_schema('{"type":"object"}')


def test_constrained_requests_batched_together_answer_as_alone(engine):
    array = {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3}
    schemas = {"obj": SCHEMA, "arr": array}
    prompt = _prompt(engine, "List things.")

    def request(name: str, suffix: str) -> EngineRequest:
        grammar = compile_json_schema(json.dumps(schemas[name])) if name in schemas else None
        params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
        return EngineRequest(f"{name}-{suffix}", prompt, params)

    alone = {name: _run(engine, request(name, "alone"))[0] for name in ("obj", "arr", "free")}
    batch = [engine.grammars.ready(request(name, "batch")) for name in ("obj", "arr", "free")]
    together = engine.generate(batch)
    for name in ("obj", "arr", "free"):
        tokens = [t for out in together[f"{name}-batch"] for t in out.new_token_ids]
        assert tokens == alone[name], name
    jsonschema.validate(json.loads(engine.tokenizer.decode(alone["arr"])), array)
