"""The pool prefix tier (workers/handoff/pool_prefix.py) over a real engine (the NumpyRunner
stand-in, whose "KV" is the token ids themselves) and a fake pool: exact lease contents, what
the pool was asked, counters, and answers equal to the reference. The fake pool injects what a
real one cannot do on cue: a key gone between lookup and load, an error, a slow get."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests.wait import async_wait_until
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import MODEL, block_value, numpy_engines, numpy_seam
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.handoff.pool_prefix import PoolPrefix, hit_run, lookup_keys
from workers.pool.keys import block_keys
from workers.prefill.stages import PrefillPlan, lease, prefix_reader
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam
from workers.server.prepare import PreparedRequest

BS = 4
NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(97 + (i * 5 + offset) % 26 for i in range(n))


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_ctx(engines, min_tokens: int = 4, timeout_s: float = 2.0) -> PDSeam:
    settings = PDSettings(
        master_addr="fake",
        metadata_url="fake",
        pool_prefix_min_tokens=min_tokens,
        pool_load_timeout_s=timeout_s,
    )
    return numpy_seam(engines[0], settings)


async def acquire_pool_prefix(ctx: PDSeam, tokens: tuple[int, ...]) -> PoolPrefix:
    """The prefix read as P's lease stage calls it, with the prompt's own keys."""
    keys = block_keys(ctx.identity.fingerprint, list(tokens), BS)
    return await prefix_reader(ctx).acquire(tokens, keys)


def fill_pool(ctx: PDSeam, tokens: tuple[int, ...], block_indices: list[int]) -> list[str]:
    """Put blocks of tokens into the fake pool, as P would have; all of tokens' full keys."""
    keys = block_keys(ctx.identity.fingerprint, list(tokens[: len(tokens) // BS * BS]), BS)
    for i in block_indices:
        ctx.pool.store[keys[i]] = block_value(tokens[i * BS : (i + 1) * BS])
    return keys


def sample(ctx: PDSeam, name: str, **labels: str) -> float:
    value = ctx.server_metrics.registry.get_sample_value(f"pdworker_{name}", labels)
    return 0.0 if value is None else value


async def run_over(engine: AsyncEngine, rid: str, tokens, prefix: PoolPrefix) -> list:
    """Add a request over prefix's lease (or plain) and collect its outputs."""
    lease = prefix.lease
    request = EngineRequest(rid, tuple(tokens), GREEDY)
    if lease is not None:
        request = EngineRequest(
            rid,
            tuple(tokens),
            GREEDY,
            preallocated_block_ids=lease.block_ids,
            num_computed_tokens=lease.num_computed_tokens,
            num_cached_tokens=lease.num_computed_tokens,
        )
    return [out async for out in engine.generate(request)]


def answer(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


async def assert_exact_answer(
    engine: AsyncEngine, tokens: tuple[int, ...], prefix: PoolPrefix, num_cached: int
) -> None:
    """Run a request over prefix: the reference answer, with num_cached tokens cached."""
    outputs = await run_over(engine, "r", tokens, prefix)
    assert answer(outputs) == reference_greedy(list(tokens), 5)
    assert outputs[-1].num_cached_tokens == num_cached


def assert_idle(llm: LLMEngine) -> None:
    llm.pool.check_integrity()
    assert llm.pool.num_used == 0


def test_hit_run_is_the_minimum_consecutive_run_over_ranks() -> None:
    assert hit_run([[True, True, False, True]]) == 2
    assert hit_run([[True, True, True], [True, False, True]]) == 1
    assert hit_run([[False, True]]) == 0
    assert hit_run([[]]) == 0 and hit_run([]) == 0


def test_lookup_keys_stop_before_the_block_of_the_last_token() -> None:
    tokens = list(range(12))
    assert len(lookup_keys("fp", tokens, 4)) == 2  # token 11 ends block 2: computed
    assert len(lookup_keys("fp", [*tokens, 5], 4)) == 3
    assert lookup_keys("fp", tokens, 4) == block_keys("fp", tokens[:8], 4)
    # chained keys: the prompt's own keys start with them (run_prefill passes those)
    assert lookup_keys("fp", [*tokens, 5], 4) == block_keys("fp", [*tokens, 5], 4)[:3]


async def test_pool_hit_is_loaded_and_the_answer_is_exact(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = prompt(14)  # 3 full blocks before the last token
    fill_pool(ctx, tokens, [0, 1, 2])
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert (prefix.num_device_tokens, prefix.num_pool_tokens) == (0, 12)
    assert prefix.lease is not None and prefix.lease.num_cached_blocks == 0
    assert len(prefix.lease.block_ids) == 3 and prefix.lease.num_computed_tokens == 12
    assert ctx.pool.calls == [("exists", 3), ("get", 3)]
    await assert_exact_answer(eng, tokens, prefix, 12)
    assert llm.runner.num_runs >= 1
    assert sample(ctx, "pool_prefix_lookups_total") == 1
    assert sample(ctx, "pool_prefix_hit_tokens_total") == 12
    assert sample(ctx, "pool_prefix_load_bytes_total") == 3 * ctx.pool.config.slot_bytes
    assert_idle(llm)


async def test_device_hit_then_pool_for_the_following_blocks(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    base = prompt(9)
    await run_over(eng, "warm", base, PoolPrefix())  # blocks 0, 1 now in the device cache
    tokens = base[:8] + prompt(9, 3)  # 17 tokens: 4 full blocks before the last token
    fill_pool(ctx, tokens, [0, 1, 2, 3])
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert (prefix.num_device_tokens, prefix.num_pool_tokens) == (8, 8)
    assert ctx.pool.calls == [("exists", 2), ("get", 2)]  # only the keys after the device hit
    await assert_exact_answer(eng, tokens, prefix, 16)
    assert_idle(llm)


async def test_a_hole_ends_the_hit(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = prompt(14)
    fill_pool(ctx, tokens, [0, 2])
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert prefix.num_pool_tokens == 4 and len(prefix.lease.block_ids) == 1
    await assert_exact_answer(eng, tokens, prefix, 4)
    assert_idle(llm)


async def test_a_hit_under_the_threshold_is_not_loaded(engines) -> None:
    _, llm = engines
    ctx = make_ctx(engines, min_tokens=16)
    tokens = prompt(14)
    fill_pool(ctx, tokens, [0, 1, 2])
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert prefix.lease is None and prefix.num_pool_tokens == 0
    assert ctx.pool.calls == [("exists", 3)]
    assert sample(ctx, "pool_prefix_loads_skipped_total", reason="threshold") == 1
    assert_idle(llm)


async def test_a_failing_lookup_means_compute(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = prompt(14)
    fill_pool(ctx, tokens, [0, 1, 2])
    ctx.pool.exists_error = True
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert prefix.lease is None and sample(ctx, "pool_prefix_errors_total") == 1
    await assert_exact_answer(eng, tokens, prefix, 0)
    assert_idle(llm)


async def test_blocks_deleted_between_lookup_and_load_are_computed(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = prompt(14)
    keys = fill_pool(ctx, tokens, [0, 1, 2])
    ctx.pool.remove_before_get = {keys[1]}
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert ctx.pool.calls == [("exists", 3), ("get", 3)]  # the lookup saw all three
    assert prefix.num_pool_tokens == 4 and len(prefix.lease.block_ids) == 1
    assert sample(ctx, "pool_prefix_errors_total") == 1
    assert llm.pool.num_used == 1  # the two blocks the pool could not fill went back
    await assert_exact_answer(eng, tokens, prefix, 4)
    assert_idle(llm)


async def test_a_load_past_its_bound_is_abandoned_and_its_blocks_kept_until_it_ends(
    engines,
) -> None:
    eng, llm = engines
    ctx = make_ctx(engines, timeout_s=0.2)
    tokens = prompt(14)
    fill_pool(ctx, tokens, [0, 1, 2])
    ctx.pool.get_delay_s = 1.0
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert prefix.lease is None and prefix.num_pool_tokens == 0
    assert sample(ctx, "pool_prefix_loads_skipped_total", reason="timeout") == 1
    # The race happened: the get still runs, and the lease's 3 blocks are still held by it.
    assert ctx.pool.get_started.is_set() and len(ctx.background) == 1
    assert llm.pool.num_used == 3
    await assert_exact_answer(eng, tokens, prefix, 0)  # computed over fresh blocks
    await async_wait_until(lambda: not ctx.background, 10.0, "the abandoned load to end")
    # The release is posted to the engine thread, which applies it before its next step.
    await async_wait_until(lambda: llm.pool.num_used, 10.0, "the lease's blocks given back",
                           done=lambda n: n == 0)  # fmt: skip
    assert_idle(llm)


async def test_all_in_the_device_cache_asks_the_pool_nothing(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = prompt(14)
    await run_over(eng, "warm", tokens, PoolPrefix())
    prefix = await acquire_pool_prefix(ctx, tokens)
    assert prefix == PoolPrefix() and ctx.pool.calls == []
    outputs = await run_over(eng, "r", tokens, prefix)
    assert outputs[-1].num_cached_tokens == 12  # the engine's own device hit
    assert_idle(llm)


async def test_turned_off_asks_the_pool_nothing(engines) -> None:
    ctx = make_ctx(engines)
    ctx = dataclasses.replace(
        ctx, settings=PDSettings(master_addr="f", metadata_url="f", pool_prefix=False)
    )
    tokens = prompt(14)
    fill_pool(ctx, tokens, [0, 1, 2])
    prepared = PreparedRequest("r", "completion", MODEL, tokens, GREEDY, False, False)
    plan = PrefillPlan(prepared, EngineRequest("r", tokens, GREEDY), ())
    assert await lease(ctx, plan) == (plan, PoolPrefix())  # P's lease stage
    assert ctx.pool.calls == []
