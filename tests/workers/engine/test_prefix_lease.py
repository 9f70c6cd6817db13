"""Prefix leases and preallocated blocks: what the pool tier and the decode role hand the
engine before a request is added, at the scheduler (exact state) and through AsyncEngine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.wait import async_wait_until
from tests.workers.engine.caching_scheduler import (
    X,
    full_hashes,
    make,
    refs,
    req,
    sources,
    step,
    tokens,
)
from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner, reference_greedy
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def test_a_lease_takes_hits_and_fresh_blocks_and_is_registered_when_added() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    longer = prompt[:8] + tokens(9, 5)  # 17 tokens: hits 0, 1; blocks 2 and 3 to fill
    h = full_hashes(longer)
    lease = s.prefix_cache.acquire(longer, max_extra_blocks=5)
    assert (lease.block_ids, lease.num_cached_blocks, lease.extra_block_ids) == (
        (0, 1, 3, 4),
        2,
        (3, 4),
    )
    assert (lease.num_device_cached_tokens, lease.num_computed_tokens) == (8, 16)
    assert refs(s, range(5)) == [1, 1, 0, 1, 1]
    s.add(
        req(
            "p",
            longer,
            preallocated_block_ids=lease.block_ids,
            num_computed_tokens=16,
            num_cached_tokens=16,
            prefill_only=True,
        )
    )
    # Blocks 3 and 4 were filled from the pool: cached as the request is added.
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1, h[2]: 3, h[3]: 4}
    assert sources(s) == (8, 8, 0, 9 + 1)
    batch, outputs = step(s)
    assert batch == [("p", 1, 16, (0, 1, 3, 4, 5))]
    assert (outputs["p"].num_cached_tokens, outputs["p"].block_ids) == (16, (0, 1, 3, 4, 5))


def test_a_lease_given_back_in_part_or_whole() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    before = s.pool.free_ids()
    assert before == [3, 4, 5, 6, 7, 2, 1, 0]
    longer = prompt[:8] + tokens(9, 5)
    lease = s.prefix_cache.acquire(longer, max_extra_blocks=2)
    kept = s.prefix_cache.trim(lease, num_filled_blocks=1)  # the pool had only block 2
    assert (kept.block_ids, kept.num_cached_blocks, kept.num_computed_tokens) == ((0, 1, 3), 2, 12)
    assert s.pool.free_ids() == [5, 6, 7, 2, 4]
    with pytest.raises(ValueError, match="trim_lease\\(\\) of 2 filled blocks: the lease has 1"):
        s.prefix_cache.trim(kept, 2)
    s.prefix_cache.free_sequence(kept.block_ids)  # release_lease: hits tail first
    assert s.pool.free_ids() == [5, 6, 7, 2, 4, 3, 1, 0]
    assert s.pool.num_used == 0 and s.pool.num_cached == 2


def test_lease_limits_room_and_the_last_token() -> None:
    s = make(num_blocks=4)
    prompt = tokens(8)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    # 8 tokens end on a boundary: the lease covers positions [0, 7). Block 1 holds the last
    # token, so it is no hit: a fresh block takes its place, to fill with positions 4..6 (the
    # engine computes position 7 into it).
    lease = s.prefix_cache.acquire(prompt, max_extra_blocks=3)
    assert (lease.block_ids, lease.num_cached_blocks, lease.num_computed_tokens) == ((0, 2), 1, 7)
    s.prefix_cache.free_sequence(lease.block_ids)
    # 9 tokens: both blocks hit, no extra block is needed.
    lease = s.prefix_cache.acquire((*prompt, X), max_extra_blocks=3)
    assert (lease.block_ids, lease.num_computed_tokens) == ((0, 1), 8)
    # No room for 3 extra blocks next to the 2 held ones: None, nothing taken.
    assert s.prefix_cache.acquire(tokens(20, 3), max_extra_blocks=3) is None
    assert refs(s, range(4)) == [1, 1, 0, 0]
    assert s.prefix_cache.acquire(tokens(20, 3), max_extra_blocks=0).block_ids == ()
    with pytest.raises(ValueError, match="at least one token"):
        s.prefix_cache.acquire((), 1)
    with pytest.raises(ValueError, match="max_extra_blocks >= 0"):
        s.prefix_cache.acquire(prompt, -1)
    # A decode-role lease for prompt + first token also covers the prompt's partial tail.
    s.prefix_cache.free_sequence(lease.block_ids)
    lease = s.prefix_cache.acquire((*tokens(10), X), max_extra_blocks=3)
    # (Block 2 went to the back of the free list when the first lease was given back.)
    assert (lease.block_ids, lease.num_cached_blocks, lease.num_computed_tokens) == (
        (0, 1, 3),
        2,
        10,
    )


def test_caching_off_lease_is_fresh_blocks_only() -> None:
    s = make(caching=False)
    s.add(req("a", tokens(9), max_tokens=1))
    step(s)
    lease = s.prefix_cache.acquire(tokens(9), max_extra_blocks=5)
    assert (lease.block_ids, lease.num_cached_blocks) == ((3, 4), 0)
    s.add(req("p", tokens(9), preallocated_block_ids=lease.block_ids, num_computed_tokens=8))
    assert s.pool.num_cached == 0


def test_preallocated_blocks_must_be_the_callers_own_or_device_hits() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("owner", prompt, prefill_only=True))
    step(s)  # holds (0, 1, 2); 0 and 1 cached
    assert s.pool.allocate(2) == [3, 4]

    def add(rid: str, block_ids: tuple[int, ...], num_computed: int, **kwargs) -> None:
        s.add(
            req(
                rid,
                kwargs.pop("prompt", prompt),
                output_token_ids=(X,),
                preallocated_block_ids=block_ids,
                num_computed_tokens=num_computed,
            )
        )

    # The owner's blocks passed without a reference of the caller's own.
    with pytest.raises(ValueError, match=r"preallocated blocks \[0, 1\] belong to live"):
        add("thief", (0, 1, 3), 9)
    # A shared block where a step would write (block 2 is the owner's partial block).
    s.pool.incref([2])
    with pytest.raises(ValueError, match=r"preallocated blocks \[2\] belong to live requests"):
        add("writer", (3, 2), 5)
    s.pool.free([2])
    # Device hits shared with the owner, with references of the caller's own: accepted.
    s.pool.incref([0, 1])
    add("shared", (0, 1, 3), 9)
    assert refs(s, range(5)) == [2, 2, 1, 1, 1]
    assert s.release("owner") and s.abort("shared")
    assert s.pool.free_ids() == [5, 6, 7, 2, 3, 1, 0]
    s.pool.touch([0, 1])  # as a lease does
    # Cached blocks of another sequence, or past the computed full blocks.
    with pytest.raises(ValueError, match=r"blocks \[0, 1\] are cached with other tokens' KV"):
        add("other", (0, 1, 4), 9, prompt=tokens(9, 1))
    with pytest.raises(ValueError, match=r"blocks \[1\] are cached with other tokens' KV"):
        add("past", (0, 1, 4), 7)
    add("hit", (0, 1, 4), 9)
    assert refs(s, range(5)) == [1, 1, 0, 0, 1]
    assert list(s.requests) == ["hit"]
    assert sources(s) == (16, 0, 2, 9)


# ---- through AsyncEngine, from the event loop ---------------------------------------------


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    """The AsyncEngine, and the LLMEngine it drives (to read exact pool state)."""
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=4,
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    llm = LLMEngine(NumpyRunner(32, 4), CharTokenizer(), config, vocab_size=128)
    eng = AsyncEngine(llm)
    eng.start()
    yield eng, llm
    assert eng.shutdown(timeout_s=5.0)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(97 + (i * 5 + offset) % 26 for i in range(n))


async def collect(engine: AsyncEngine, request: EngineRequest) -> list:
    return [out async for out in engine.generate(request)]


async def test_prefix_lease_from_the_event_loop(engines) -> None:
    """The pool tier's path: a lease of device hits and fresh blocks, filled outside the
    engine thread, then a request over it; part of it given back."""
    engine, llm = engines
    base = prompt(9)
    await collect(engine, EngineRequest("warm", base, GREEDY))
    assert engine.stats().num_kv_blocks_cached == 4  # 2 prompt blocks, 2 of prompt + output
    longer = base[:8] + prompt(9, 3)  # 17 tokens: blocks 0-1 cached, 2-3 to fill
    lease = await engine.acquire_prefix(longer, max_extra_blocks=2)
    assert (lease.num_cached_blocks, len(lease.extra_block_ids)) == (2, 2)
    assert engine.stats().num_kv_blocks_used == 4
    kept = await engine.trim_lease(lease, 1)  # the pool had block 2 only
    assert kept.block_ids == lease.block_ids[:3] and kept.num_computed_tokens == 12
    assert engine.stats().num_kv_blocks_used == 3
    llm.runner.write(list(kept.block_ids), list(longer[:12]), start_pos=8)  # "from the pool"
    request = EngineRequest(
        "p",
        longer,
        GREEDY,
        preallocated_block_ids=kept.block_ids,
        num_computed_tokens=12,
        num_cached_tokens=12,
    )
    outputs = await collect(engine, request)
    assert [t for o in outputs for t in o.new_token_ids] == reference_greedy(list(longer), 10)
    assert {o.num_cached_tokens for o in outputs} == {12}
    stats = engine.stats()
    assert stats.num_prompt_tokens_device_hit_total == 8
    assert stats.num_prompt_tokens_given_cached_total == 4
    assert stats.num_prompt_tokens_computed_total == 9 + 5
    # A lease given back whole: its hits stay cached, nothing stays referenced.
    engine.release_lease(await engine.acquire_prefix(longer, max_extra_blocks=4))
    await async_wait_until(lambda: engine.stats().num_kv_blocks_used == 0, 5, "the release")


async def test_refused_lease_request_gives_back_its_references(engines) -> None:
    engine, llm = engines
    (held,) = await collect(engine, EngineRequest("same", prompt(9), GREEDY, prefill_only=True))
    assert held.block_ids == (0, 1, 2)
    lease = await engine.acquire_prefix(prompt(9), max_extra_blocks=0)
    assert lease.block_ids == (0, 1)  # shared with the held request
    request = EngineRequest(
        "same",
        prompt(9),
        GREEDY,
        preallocated_block_ids=lease.block_ids,
        num_computed_tokens=8,
        num_cached_tokens=8,
    )
    # Refused by the engine thread ("same" is still held): the lease's own references on the
    # shared blocks are dropped, the held request's stay.
    with pytest.raises(ValueError, match="already in the engine"):
        await collect(engine, request)
    # (The refusal came from the engine thread: it is applied already.)
    assert [llm.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    engine.release("same")
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 0, 5, "engine.stats().num_kv_blocks_used == 0"
    )
    assert engine.stats().num_kv_blocks_cached == 2
