"""AsyncEngine over the numpy stand-in runner: streaming, abort on disconnect, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from tests.wait import async_wait_until
from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner, reference_greedy
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine, EngineDeadError
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


class FailingRunner(NumpyRunner):
    """Fault injection: the model raises on its Nth run (a real model cannot be told to)."""

    def __init__(self, *args, fail_on_run: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_on_run = fail_on_run

    def run(self, batch):
        if self.num_runs + 1 == self.fail_on_run:
            self.num_runs += 1
            raise RuntimeError("injected device fault")
        return super().run(batch)


class GatedRunner(NumpyRunner):
    """Runs a step only with a permit from the test, so that what the engine thread has done
    when the test acts is known (the numpy model is otherwise fast enough to finish a whole
    request before the test's next line)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._permits = threading.Semaphore(0)
        self._open = False
        self.entered = threading.Event()  # a step is waiting for its permit, or ran

    def allow(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._permits.release()

    def open(self) -> None:
        self._open = True
        self._permits.release()  # wake a step already waiting

    def run(self, batch):
        self.entered.set()
        if not self._open:
            assert self._permits.acquire(timeout=10.0), "the test never allowed this step"
        return super().run(batch)


def build(num_blocks: int = 32, block_size: int = 4, runner=None, **kwargs) -> AsyncEngine:
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=64,
        max_model_len=min(64, num_blocks * block_size),
    )
    runner = runner or NumpyRunner(num_blocks, block_size)
    engine = AsyncEngine(LLMEngine(runner, CharTokenizer(), config, vocab_size=128), **kwargs)
    engine.start()
    return engine


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    eng = build()
    yield eng
    assert eng.shutdown(timeout_s=5.0)


@pytest.fixture
def gated() -> Iterator[tuple[AsyncEngine, GatedRunner]]:
    runner = GatedRunner(32, 4)
    eng = build(runner=runner)
    yield eng, runner
    runner.open()
    assert eng.shutdown(timeout_s=5.0)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(97 + (i * 5 + offset) % 26 for i in range(n))


async def collect(engine: AsyncEngine, request: EngineRequest) -> list:
    return [out async for out in engine.generate(request)]


async def test_concurrent_streams_get_their_own_tokens(engine: AsyncEngine) -> None:
    requests = [EngineRequest(f"r{i}", prompt(3 + i, i), GREEDY) for i in range(8)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for request, outputs in zip(requests, results, strict=True):
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert tokens == reference_greedy(list(request.prompt_token_ids), 10)
        assert [o.finished for o in outputs] == [False] * 9 + [True]
    await async_wait_until(
        lambda: engine.stats().num_generation_tokens_total == 80,
        5,
        "engine.stats().num_generation_tokens_total == 80",
    )
    assert engine.stats().num_kv_blocks_used == 0


async def test_consumer_that_stops_early_aborts_the_request(gated) -> None:
    engine, runner = gated
    runner.allow(1)
    gen = engine.generate(EngineRequest("early", prompt(5), SamplingParams(max_tokens=40)))
    first = await gen.__anext__()
    assert first.num_output_tokens == 1
    await gen.aclose()
    runner.open()
    await async_wait_until(
        lambda: engine.stats().num_running == 0, 5, "engine.stats().num_running == 0"
    )
    assert engine.stats().num_kv_blocks_used == 0
    # The step already waiting for its permit may finish; then the abort applies.
    assert engine.stats().num_generation_tokens_total in (1, 2)


async def test_cancelled_consumer_aborts_the_request() -> None:
    engine = build(num_blocks=4, block_size=4)
    try:
        held = await engine.allocate_blocks(4)  # the request must wait: nothing else can happen
        task = asyncio.create_task(collect(engine, EngineRequest("c", prompt(3), GREEDY)))
        await async_wait_until(
            lambda: engine.stats().num_waiting == 1, 5, "engine.stats().num_waiting == 1"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await async_wait_until(
            lambda: engine.stats().num_waiting == 0, 5, "engine.stats().num_waiting == 0"
        )
        engine.free_blocks(held)
        await async_wait_until(
            lambda: engine.stats().num_kv_blocks_used == 0, 5, "the blocks to go back"
        )
    finally:
        assert engine.shutdown(timeout_s=5.0)


async def test_external_abort_ends_the_stream_with_abort(gated) -> None:
    engine, runner = gated
    runner.allow(2)
    outputs = []
    async for out in engine.generate(EngineRequest("x", prompt(4), SamplingParams(max_tokens=60))):
        outputs.append(out)
        if len(outputs) == 2:
            engine.abort("x")
            runner.open()
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].new_token_ids == ()
    assert outputs[-1].num_output_tokens == len(outputs) - 1
    assert len(outputs) in (3, 4)


async def test_invalid_and_duplicate_requests_raise_value_error(gated) -> None:
    engine, runner = gated
    with pytest.raises(ValueError, match="prompt is empty"):
        await collect(engine, EngineRequest("e", (), GREEDY))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.validate(EngineRequest("m", (97,), SamplingParams(max_tokens=0)))
    first = engine.generate(EngineRequest("dup", prompt(3), GREEDY))
    with pytest.raises(ValueError, match="already being generated"):
        engine.generate(EngineRequest("dup", prompt(3), GREEDY))
    runner.open()
    outputs = [out async for out in first]
    assert outputs[-1].num_output_tokens == 10


async def test_prefill_only_then_release(engine: AsyncEngine) -> None:
    request = EngineRequest("p", prompt(9), GREEDY, prefill_only=True)
    (out,) = await collect(engine, request)
    assert (out.finish_reason, out.block_ids) == ("prefill_done", (0, 1, 2))
    assert engine.stats().num_kv_blocks_used == 3
    # A held id cannot be reused until released.
    with pytest.raises(ValueError, match="already in the engine"):
        await collect(engine, request)
    engine.release("p")
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 0, 5, "engine.stats().num_kv_blocks_used == 0"
    )


async def test_a_refused_duplicate_closed_at_once_leaves_the_holder_alone(
    engine: AsyncEngine,
) -> None:
    """A stream for an id the engine still holds (a finished prefill_only request awaiting
    its release) is refused by the engine thread; closing that stream before the refusal
    arrives used to abort by id, and so freed the holder's blocks under its writer."""
    (held,) = await collect(engine, EngineRequest("held", prompt(9), GREEDY, prefill_only=True))
    assert held.block_ids == (0, 1, 2)
    with engine._cond:  # add and abort reach the engine thread in one batch, in this order
        refused = engine.generate(EngineRequest("held", prompt(5), GREEDY))
        await refused.aclose()
        assert len(engine._inbox) == 2  # the add, then the stream's abort
    await async_wait_until(lambda: not engine._inbox, 5, "the inbox applied")
    assert engine.stats().num_kv_blocks_used == 3  # the holder's blocks, untouched
    with pytest.raises(ValueError, match="already in the engine"):  # still held, not aborted
        await collect(engine, EngineRequest("held", prompt(9), GREEDY, prefill_only=True))
    engine.release("held")
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 0, 5, "engine.stats().num_kv_blocks_used == 0"
    )


async def test_free_blocks_unblocks_a_waiting_request() -> None:
    engine = build(num_blocks=4, block_size=4)
    try:
        held = await engine.allocate_blocks(4)
        assert await engine.allocate_blocks(1) is None
        task = asyncio.create_task(collect(engine, EngineRequest("w", prompt(3), GREEDY)))
        await async_wait_until(
            lambda: engine.stats().num_waiting == 1, 5, "engine.stats().num_waiting == 1"
        )
        engine.free_blocks(held)
        outputs = await asyncio.wait_for(task, 5.0)
        assert outputs[-1].finish_reason == "length"
    finally:
        assert engine.shutdown(timeout_s=5.0)


async def test_engine_failure_fails_in_flight_requests_and_later_calls() -> None:
    engine = build(runner=FailingRunner(32, 4, fail_on_run=3))
    try:
        tasks = [
            asyncio.create_task(collect(engine, EngineRequest(f"f{i}", prompt(4, i), GREEDY)))
            for i in range(3)
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            assert isinstance(result, EngineDeadError)
            assert "injected device fault" in str(result)
        assert not engine.is_healthy()
        assert isinstance(engine.error, RuntimeError)
        with pytest.raises(EngineDeadError, match="injected device fault"):
            await collect(engine, EngineRequest("late", prompt(3), GREEDY))
        with pytest.raises(EngineDeadError):
            await engine.allocate_blocks(1)
    finally:
        assert engine.shutdown(timeout_s=5.0)


async def test_silent_engine_times_out_the_request() -> None:
    engine = build(num_blocks=4, block_size=4, output_timeout_s=0.3)
    try:
        held = await engine.allocate_blocks(4)
        with pytest.raises(TimeoutError, match=r"no output from the engine for 0\.3 s"):
            await collect(engine, EngineRequest("t", prompt(3), GREEDY))
        await async_wait_until(
            lambda: engine.stats().num_waiting == 0, 5, "engine.stats().num_waiting == 0"
        )
        engine.free_blocks(held)
    finally:
        assert engine.shutdown(timeout_s=5.0)


async def test_shutdown_fails_waiting_requests() -> None:
    engine = build(num_blocks=4, block_size=4)
    await engine.allocate_blocks(4)
    task = asyncio.create_task(collect(engine, EngineRequest("s", prompt(3), GREEDY)))
    await async_wait_until(
        lambda: engine.stats().num_waiting == 1, 5, "engine.stats().num_waiting == 1"
    )
    assert engine.shutdown(timeout_s=5.0)
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(task, 5.0)
    assert not engine.is_healthy()


async def test_refused_decode_request_gives_its_blocks_back(engine: AsyncEngine) -> None:
    (held,) = await collect(engine, EngineRequest("same", prompt(3), GREEDY, prefill_only=True))
    assert held.block_ids == (0,)
    block_ids = await engine.allocate_blocks(2)
    assert engine.stats().num_kv_blocks_used == 3

    def decode_request(rid: str, params: SamplingParams) -> EngineRequest:
        return EngineRequest(
            rid,
            prompt(5),
            params,
            output_token_ids=(97,),
            preallocated_block_ids=tuple(block_ids),
            num_computed_tokens=5,
        )

    # Refused by the engine thread: "same" is still held.
    with pytest.raises(ValueError, match="already in the engine"):
        await collect(engine, decode_request("same", GREEDY))
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 1, 5, "engine.stats().num_kv_blocks_used == 1"
    )
    # Refused at the call (max_tokens=1 is already reached by the given token): the caller
    # still owns the blocks.
    block_ids = await engine.allocate_blocks(2)
    with pytest.raises(ValueError, match="already reach max_tokens=1"):
        engine.generate(decode_request("other", SamplingParams(max_tokens=1)))
    assert engine.stats().num_kv_blocks_used == 3
    engine.free_blocks(block_ids)
    engine.release("same")
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 0, 5, "engine.stats().num_kv_blocks_used == 0"
    )


async def test_blocks_of_a_live_request_are_never_reclaimed(engine: AsyncEngine) -> None:
    (owner,) = await collect(engine, EngineRequest("owner", prompt(3), GREEDY, prefill_only=True))
    assert owner.block_ids == (0,)
    stolen = EngineRequest(
        "thief",
        prompt(3),
        GREEDY,
        output_token_ids=(97,),
        preallocated_block_ids=(0,),
        num_computed_tokens=3,
    )
    with pytest.raises(ValueError, match=r"preallocated blocks \[0\] belong to live requests"):
        await collect(engine, stolen)
    assert engine.stats().num_kv_blocks_used == 1  # still the owner's
    engine.release("owner")
    await async_wait_until(
        lambda: engine.stats().num_kv_blocks_used == 0, 5, "engine.stats().num_kv_blocks_used == 0"
    )


async def test_a_stream_dropped_unread_aborts_its_request(gated) -> None:
    engine, runner = gated
    stream = engine.generate(EngineRequest("dropped", prompt(4), SamplingParams(max_tokens=60)))
    del stream
    runner.open()

    def added_then_aborted() -> bool:
        stats = engine.stats()
        return stats.num_prompt_tokens_total == 4 and stats.num_running + stats.num_waiting == 0

    await async_wait_until(added_then_aborted, 5, "added_then_aborted()")
    assert engine.stats().num_kv_blocks_used == 0
    # Dropped before any step ran, or while the first one waited for its permit.
    assert engine.stats().num_generation_tokens_total in (0, 1)


async def test_from_config_serves_the_tiny_model_from_its_thread(tmp_path) -> None:
    config = EngineConfig(model="tiny", cache_dir=str(tmp_path), num_kv_blocks=64, block_size=8)
    engine = AsyncEngine.from_config(config)
    engine.start()
    try:
        assert engine.engine_config.max_model_len == 512  # capped by 64 blocks x 8 tokens
        assert engine.model_config.model_id == "tiny-0"
        tokenizer = engine.tokenizer
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        requests = [
            EngineRequest(f"t{i}", tuple(tokenizer.encode(text)), params)
            for i, text in enumerate(["Hello", "The engine thread", "runs Paddle"])
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        # The same requests through the synchronous engine, one at a time.
        sync_engine = LLMEngine.from_config(config)
        for request, outputs in zip(requests, results, strict=True):
            expected = sync_engine.generate([request])[request.request_id]
            assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
            assert "".join(o.new_text for o in outputs) == "".join(o.new_text for o in expected)
        assert engine.stats().num_generation_tokens_total == 24
        assert len(engine.kv_caches) == 2 * engine.model_config.num_layers
    finally:
        assert engine.shutdown(timeout_s=10.0)


async def test_cancel_is_not_swallowed_when_an_output_is_ready() -> None:
    runner = GatedRunner(32, 4)
    engine = build(runner=runner)
    try:
        stream = engine.generate(EngineRequest("s", prompt(3), GREEDY))
        task = asyncio.create_task(stream.__anext__())
        queue = stream._stream.queue
        # The race needs the consumer parked in queue.get() before the output arrives.
        await async_wait_until(lambda: len(queue._getters), 5, "the consumer to wait on its queue")
        runner.allow(1)
        await async_wait_until(
            lambda: not queue.empty(), 5, "the first output queued", interval_s=0
        )
        # The output is queued: one loop turn lets the getter finish, then the consumer is
        # cancelled before it resumes. The cancellation must win over the ready output.
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        runner.open()
        assert engine.shutdown(timeout_s=5.0)


async def test_block_calls_wait_for_the_step_off_the_loop_and_leave_nothing_when_cancelled(
    gated,
) -> None:
    engine, runner = gated
    lease = await engine.acquire_prefix(prompt(9), max_extra_blocks=2)  # 2 fresh blocks
    assert engine.stats().num_kv_blocks_used == 2
    running = asyncio.create_task(collect(engine, EngineRequest("s", prompt(3), GREEDY)))
    await async_wait_until(runner.entered.is_set, 5, "the step to be held")
    # The engine thread is inside a step: the calls wait for it, the loop does not.
    allocate = asyncio.create_task(engine.allocate_blocks(3))
    trim = asyncio.create_task(engine.trim_lease(lease, 0))
    for _ in range(20):  # the loop runs both calls up to their wait on the engine thread
        await asyncio.sleep(0)
    assert not allocate.done() and not trim.done()
    allocate.cancel()
    trim.cancel()  # never applied: the lease it was handed goes back
    runner.open()
    await running
    await async_wait_until(lambda: engine.stats().num_kv_blocks_used == 0, 5, "every block back")
    assert await engine.allocate_blocks(32) is not None  # all 32 free again


async def test_a_group_stream_ends_with_its_last_sequence(engine: AsyncEngine) -> None:
    request = EngineRequest("g", prompt(9), GREEDY, sequence_seeds=(1, 2, 3))
    outputs = await collect(engine, request)
    expected = reference_greedy(list(prompt(9)), 10)
    for j in range(3):
        mine = [o for o in outputs if o.sequence_index == j]
        assert [t for o in mine for t in o.new_token_ids] == expected
    assert [o.ends_stream for o in outputs] == [False] * 29 + [True]
    assert sum(o.finished for o in outputs) == 3
    await async_wait_until(lambda: engine.stats().num_kv_blocks_used == 0, 5, "blocks back")


async def test_closing_a_group_stream_aborts_every_sequence(
    gated: tuple[AsyncEngine, GatedRunner],
) -> None:
    engine, runner = gated
    stream = engine.generate(EngineRequest("g", prompt(9), GREEDY, sequence_seeds=(1, 2, 3)))
    runner.allow(2)  # the prompt (every first token), then one batch of three
    outputs = [await anext(stream) for _ in range(6)]
    assert sorted(o.sequence_index for o in outputs) == [0, 0, 1, 1, 2, 2]
    await stream.aclose()
    runner.open()
    await async_wait_until(lambda: engine.stats().num_kv_blocks_used == 0, 5, "blocks back")
    assert engine.stats().num_running == 0
