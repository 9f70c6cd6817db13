"""P's prefix read with a host tier: the hit runs device, then host, then pool, and the pool is
asked only for the keys after the host run (the real engine over the NumpyRunner stand-in and
the fake pool of test_pool_prefix.py; the host tier copies with the real swap_cache_layout)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import numpy_engines
from tests.workers.handoff.test_pool_prefix import (
    BS,
    NUM_BLOCKS,
    acquire_pool_prefix,
    answer,
    assert_idle,
    fill_pool,
    make_ctx,
    prompt,
    run_over,
)
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.handoff.pool_prefix import PoolPrefix

HOST_SLOTS = 16
SLOT_BYTES = 2 * BS * 8  # K and V of the stand-in's int64 "KV" (fake_pool.kv_views)


@pytest.fixture(params=["write_through", "write_back"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS, swap_space_gib=HOST_SLOTS * SLOT_BYTES / 2**30,
                             write_policy=request.param)  # fmt: skip


async def test_the_hit_runs_device_then_host_then_pool(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    base = prompt(9)
    # 9 prompt + 5 output tokens: blocks 0, 1 and 2 (completed by the output) cached
    await run_over(eng, "warm", base, PoolPrefix())
    blocks = await eng.allocate_blocks(NUM_BLOCKS)  # every block: all three evicted
    assert blocks is not None and llm.pool.num_cached == 0
    eng.free_blocks(blocks)
    assert llm.host_tier is not None and llm.host_tier.stats().num_used == 3
    tokens = base[:8] + prompt(9, 3)  # 17 tokens: 4 full blocks before the last token
    fill_pool(ctx, tokens, [0, 1, 2, 3])
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert (prefix.num_device_tokens, prefix.num_pool_tokens) == (8, 8)  # device: the host's
    assert ctx.pool.calls == [("exists", 2), ("get", 2)]  # only the keys after the host run
    outputs = await run_over(eng, "r", tokens, prefix)
    assert answer(outputs) == reference_greedy(list(tokens), 5)
    assert (outputs[-1].num_cached_tokens, outputs[-1].num_host_cached_tokens) == (16, 8)
    stats = llm.stats()
    assert (stats.num_prompt_tokens_host_hit_total, stats.num_prompt_tokens_device_hit_total,
            stats.num_prompt_tokens_given_cached_total) == (8, 0, 8)  # fmt: skip
    assert stats.host_tier is not None and stats.host_tier.blocks_read == 2
    assert_idle(llm)


async def test_routers_hear_of_the_host_tier_blocks_as_of_the_device_ones(engines) -> None:
    eng, llm = engines
    await run_over(eng, "warm", prompt(9), PoolPrefix())
    events, tier = llm.pool.events, llm.host_tier
    assert events is not None and tier is not None
    cached = set(llm.pool.cached_blocks())
    assert len(cached) == 3 and events.held("device") == cached
    # write_through copied them at the end of their step; write_back waits for the eviction
    assert (
        events.held("host") == set(tier.entries()) == (cached if tier.stats().num_used else set())
    )
    blocks = await eng.allocate_blocks(NUM_BLOCKS)  # every block: all three evicted from device
    assert blocks is not None
    assert events.held("device") == set() and events.held("host") == cached
    eng.free_blocks(blocks)
