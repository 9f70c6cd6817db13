"""cache_aware: the approximate prefix tree per P, the longest match while loads are close,
least loaded when they are not (or nothing matches)."""

from __future__ import annotations

import json

from pdrouter.router.instances.instance import Instance
from pdrouter.router.selection.cache_aware import (
    CHUNK_CHARS,
    CacheAware,
    chunk_names,
    prompt_text,
)
from pdrouter.router.selection.policies import make_policy

SYSTEM = "s" * (3 * CHUNK_CHARS)


def _ps(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9100 + i}", "prefill") for i in range(n)]


def _chat(*contents: str, max_tokens: int = 8) -> bytes:
    messages = [{"role": "user", "content": c} for c in contents]
    return json.dumps({"model": "m", "max_tokens": max_tokens, "messages": messages}).encode()


def test_prompt_text_ignores_everything_but_the_prompt() -> None:
    assert prompt_text(_chat("a", max_tokens=1)) == prompt_text(_chat("a", max_tokens=99))
    assert prompt_text(b'{"prompt": "abc", "max_tokens": 3}') == "abc"
    assert prompt_text(b"not json") == "" and prompt_text(b"[1]") == ""


def test_chunk_names_are_chained() -> None:
    a = chunk_names("x" * CHUNK_CHARS + "y" * CHUNK_CHARS + "z")
    b = chunk_names("w" * CHUNK_CHARS + "y" * CHUNK_CHARS)
    assert len(a) == 2 and a[1] != b[1]  # same chunk after another prefix: another name
    assert chunk_names("short") == []


def test_the_p_that_saw_the_prefix_gets_the_next_turn() -> None:
    policy = CacheAware()
    ps = _ps(2)
    ps[0].in_flight = 1  # the first request goes to the least loaded: P1
    assert policy.pick_for(ps, _chat(SYSTEM, "q1")) is ps[1]
    ps[0].in_flight = 0
    # Loads equal: P1 has the prefix (3 chunks), P0 nothing.
    assert policy.pick_for(ps, _chat(SYSTEM, "q2")) is ps[1]
    assert policy.match(ps[1].url, chunk_names(prompt_text(_chat(SYSTEM, "q3")))) == 3
    assert policy.match(ps[0].url, chunk_names(prompt_text(_chat(SYSTEM, "q3")))) == 0


def test_imbalance_falls_back_to_least_loaded() -> None:
    policy = CacheAware(imbalance_abs=2, imbalance_ratio=1.5)
    ps = _ps(2)
    policy.pick_for(ps, _chat(SYSTEM))  # P0 learns it (tie: least loaded, list order)
    ps[0].in_flight, ps[1].in_flight = 3, 1  # 2 apart: still close
    assert policy.pick_for(ps, _chat(SYSTEM)) is ps[0]
    ps[0].in_flight = 4  # 3 apart and 4 > 1.5 * 1: too far
    assert policy.pick_for(ps, _chat(SYSTEM)) is ps[1]


def test_no_match_is_least_loaded_and_lru_bounds_each_tree() -> None:
    policy = CacheAware(max_chunks=2)
    ps = _ps(2)
    ps[0].in_flight = 1
    assert policy.pick_for(ps, _chat("u" * 10)) is ps[1]  # no full chunk: least loaded
    policy.learn(ps[0].url, chunk_names(SYSTEM))
    assert len(policy.trees[ps[0].url]) == 2
    assert policy.match(ps[0].url, chunk_names(SYSTEM)) == 0  # its first chunk was evicted
    assert make_policy("cache_aware").name == "cache_aware"
    assert policy.pick(ps) is ps[1]
