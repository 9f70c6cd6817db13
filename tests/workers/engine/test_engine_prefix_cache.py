"""The device prefix cache on the tiny Paddle model: the same tokens as without it (greedy
and seeded), with num_cached_tokens exact, turn by turn and in a tight batch."""

from __future__ import annotations

import pytest

from tests.workers.engine.tiny_engine import encoded, real_engine, tokens_of
from workers.engine.api import EngineRequest, SamplingParams

LONG = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
SYSTEM = "You are a terse assistant. "[:16]  # 4 blocks of 4 byte-level tokens


@pytest.mark.parametrize("params", [LONG, SEEDED], ids=["greedy", "seeded"])
def test_real_model_prefix_cache_turn_by_turn(loaded, params) -> None:
    """Requests one after another: each finds what the ones before it left in the cache."""
    base = encoded(loaded, SYSTEM)
    assert len(base) == 16
    engines = {on: real_engine(loaded, prefix_cache=on) for on in (True, False)}
    turns = [
        (base + encoded(loaded, "abc"), 0),  # 19 tokens, nothing cached yet
        (base + encoded(loaded, "de"), 16),  # the 4 system blocks
        (base, 12),  # ends on a block boundary: its last block is recomputed
        (base + encoded(loaded, "!"), 16),  # one token past the boundary
        (None, 32),  # the first turn's prompt + answer + 2 tokens: 8 of its blocks
        (encoded(loaded, "Nothing shared here"), 0),
    ]
    answers: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    for i, (request_prompt, num_cached) in enumerate(turns):
        for on, engine in engines.items():
            if request_prompt is None:  # the first turn's prompt and answer, then more
                first = turns[0][0] + answers[on][0]
                request_prompt = first + encoded(loaded, "ok")
            (outputs,) = engine.generate([EngineRequest(f"t{i}", request_prompt, params)]).values()
            answers[on].append(tuple(tokens_of(outputs)))
            assert {o.num_cached_tokens for o in outputs} == {num_cached if on else 0}
        assert answers[True][i] == answers[False][i], f"turn {i}"
        assert len(answers[True][i]) == 16
    stats = engines[True].stats()
    assert stats.num_prompt_tokens_device_hit_total == 16 + 12 + 16 + 32
    assert stats.num_prompt_tokens_computed_total == stats.num_prompt_tokens_total - 76
    assert engines[False].stats().num_prompt_tokens_device_hit_total == 0
    for engine in engines.values():
        engine.pool.check_integrity()
        assert engine.pool.num_used == 0


@pytest.mark.parametrize("params", [LONG, SEEDED], ids=["greedy", "seeded"])
def test_real_model_prefix_cache_with_chunks_and_preemption(loaded, params) -> None:
    """One batch sharing a system prompt on a tight pool with a small token budget: chunked
    prefills over shared blocks, preemptions and evictions, and still the same tokens."""
    base = encoded(loaded, SYSTEM)
    suffixes = ["How are you?", "Hi", "What is a KV cache?", "Go", "Name three colours"]
    requests = [
        EngineRequest(f"r{i}", base + encoded(loaded, text), params)
        for i, text in enumerate(suffixes)
    ]
    requests.append(EngineRequest("other", encoded(loaded, "Unrelated prompt"), params))
    results = {}
    for on in (True, False):
        engine = real_engine(loaded, num_blocks=24, budget=8, prefix_cache=on)
        warm = engine.generate([EngineRequest("warm", base + encoded(loaded, "x"), params)])
        assert {o.num_cached_tokens for o in warm["warm"]} == {0}
        results[on] = engine.generate(requests)
        assert engine.stats().num_preemptions_total > 0
        engine.pool.check_integrity()
        assert engine.pool.num_used == 0
    for request in requests:
        rid = request.request_id
        assert tokens_of(results[True][rid]) == tokens_of(results[False][rid]), rid
        # Every request sharing the system prompt found its 4 blocks when first scheduled:
        # "warm" left them cached, and r0 holds them from the first step on.
        expected = 0 if rid == "other" else 16
        assert {o.num_cached_tokens for o in results[True][rid]} == {expected}, rid
        assert {o.num_cached_tokens for o in results[False][rid]} == {0}, rid
