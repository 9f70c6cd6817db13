"""workers.engine.prompt_logprobs: each prompt token's log probability given the tokens
before it, over chunked prefills and past the device prefix cache, only when asked."""

from __future__ import annotations

from tests.workers.engine.test_engine import make_engine, prompt
from tests.workers.engine.test_logprobs import _reference
from workers.engine.api import EngineRequest, SamplingParams


def _expected(tokens: tuple[int, ...]) -> list[tuple[int, float]]:
    return [
        (tokens[i], float(_reference(list(tokens[:i]))[tokens[i]])) for i in range(1, len(tokens))
    ]


def test_prompt_logprobs_on_the_first_token_event_across_chunks() -> None:
    tokens = prompt(21)
    # budget 8: the prompt is computed in three chunks, each reporting its rows
    engine = make_engine(budget=8)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    outputs = engine.generate([EngineRequest("s", tokens, params)])["s"]
    first = outputs[0]
    assert first.new_token_ids and first.prompt_logprobs is not None
    assert [(e.token_id, round(e.logprob, 9)) for e in first.prompt_logprobs] == [
        (t, round(lp, 9)) for t, lp in _expected(tokens)
    ]
    assert all(len(e.top) == 2 for e in first.prompt_logprobs)
    assert all(o.prompt_logprobs is None for o in outputs[1:])


def test_a_scored_prompt_skips_the_prefix_cache_and_others_are_untouched() -> None:
    tokens = prompt(17)
    engine = make_engine()
    plain = engine.generate(
        [EngineRequest("a", tokens, SamplingParams(max_tokens=2, temperature=0.0))]
    )["a"]
    assert plain[0].prompt_logprobs is None
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    outputs = engine.generate([EngineRequest("b", tokens, scored)])["b"]
    # the blocks "a" cached are not taken: every prompt position was computed
    assert outputs[0].num_cached_tokens == 0
    assert len(outputs[0].prompt_logprobs) == len(tokens) - 1
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in plain]
    again = engine.generate(
        [EngineRequest("c", tokens, SamplingParams(max_tokens=2, temperature=0.0))]
    )["c"]
    assert again[0].num_cached_tokens == 16
