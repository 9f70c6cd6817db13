"""Nothing that waits on the engine runs on the event loop: with a step of 200 ms (a GPU step
of a long batch), the block and lease calls the P/D handlers make (allocate, free, acquire,
trim, release; through the decode allocate stage, the pool prefix read and the write-back)
never hold the loop. A 10 ms timer fires on time, /health answers at once and another
request's tokens keep coming while they are pending.

A call that took the engine lock on the loop would hold it until the step in progress ends
(up to 200 ms here); BOUND_S, half a step, tells the two apart with room for a loaded CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx

from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner
from tests.workers.handoff.fake_pool import MODEL, block_value, kv_views, numpy_seam
from workers.decode import stages as decode_stages
from workers.decode.stream import writeback_target
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.handoff.writeback import WriteBack
from workers.pool.keys import block_keys
from workers.prefill.stages import prefix_reader
from workers.server.app import create_app
from workers.server.config import AppConfig, PDSettings

STEP_S = 0.2
TICK_S = 0.01
BOUND_S = STEP_S / 2
BS = 4


class SlowRunner(NumpyRunner):
    """The numpy stand-in with a 200 ms step, as a large batch takes on a GPU."""

    def run(self, batch):
        time.sleep(STEP_S)
        return super().run(batch)


def slow_engine() -> AsyncEngine:
    """Not started: the app's loader starts it."""
    config = EngineConfig(model=MODEL, block_size=BS, num_kv_blocks=64, max_model_len=64)
    runner = SlowRunner(64, BS)
    runner.kv_caches = kv_views(runner.cache)
    return AsyncEngine(LLMEngine(runner, CharTokenizer(), config, vocab_size=128))


class LoopWatch:
    """How late a TICK_S timer fired on the loop, the worst case while it ran."""

    def __init__(self) -> None:
        self.worst_late_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(TICK_S)
            self.worst_late_s = max(self.worst_late_s, time.monotonic() - t0 - TICK_S)

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[LoopWatch]:
        self._task = asyncio.create_task(self._tick())
        try:
            yield self
        finally:
            self._task.cancel()


async def busy_stream(engine: AsyncEngine, gaps_s: list[float]) -> None:
    """Another request, decoding all along: the gaps between its outputs."""
    params = SamplingParams(max_tokens=20, temperature=0.0)
    last = time.monotonic()
    async for _ in engine.generate(EngineRequest("busy", tuple(range(97, 105)), params)):
        now = time.monotonic()
        gaps_s.append(now - last)
        last = now


async def timed(call: Awaitable[object]) -> float:
    t0 = time.monotonic()
    await call
    return time.monotonic() - t0


async def test_block_and_lease_calls_never_hold_the_event_loop() -> None:
    app = create_app(AppConfig(role="decode", served_model_names=(MODEL,)), slow_engine)
    state = app.state.worker
    await state.load(lambda exc: None)
    engine = state.engine
    settings = PDSettings(master_addr="f", metadata_url="f", pool_prefix_min_tokens=BS)
    seam = numpy_seam(engine, settings, "decode")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w")
    health_s: list[float] = []
    gaps_s: list[float] = []
    prompt = tuple(65 + i % 26 for i in range(13))  # nothing in common with "busy"
    keys = block_keys(seam.identity.fingerprint, prompt, BS)
    for i, key in enumerate(keys[:3]):  # the pool holds the prompt's first 3 blocks
        seam.pool.store[key] = block_value(prompt[i * BS : (i + 1) * BS])

    async def health_while(work: Callable[[], Awaitable[object]]) -> object:
        """work(), with /health asked while it is pending."""
        job = asyncio.ensure_future(work())
        while not job.done():
            t0 = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            health_s.append(time.monotonic() - t0)
            await asyncio.wait({job}, timeout=0.02)  # the next probe, unless work is done
        return job.result()

    try:
        busy = asyncio.create_task(busy_stream(engine, gaps_s))
        while len(gaps_s) < 2:  # decoding: every call below waits for a step to end
            await asyncio.sleep(TICK_S)
        async with LoopWatch().watching() as watch:
            block_ids = await health_while(lambda: decode_stages.allocate(seam, 3))
            engine.free_blocks(block_ids)
            prefix = await health_while(lambda: prefix_reader(seam).acquire(prompt, keys))
            assert prefix.num_pool_tokens == 3 * BS  # acquire, load, trim
            engine.release_lease(prefix.lease)
            wb = WriteBack(1, seam.cache_metrics, seam.metrics.bytes_written, seam.background)
            assert wb.submit(writeback_target(seam), "done", prompt)
            while seam.background:
                await health_while(lambda: asyncio.sleep(0.05))
        await busy
    finally:
        await client.aclose()
        state.shutdown()
    assert len(health_s) >= 4, "the calls ended before /health was asked while one pended"
    assert watch.worst_late_s < BOUND_S, f"a {TICK_S}s timer fired {watch.worst_late_s:.3f}s late"
    assert max(health_s) < BOUND_S, f"/health took {max(health_s):.3f}s"
    # The other request's tokens came a step apart (its own step, not the calls' waits).
    assert max(gaps_s[2:]) < STEP_S + BOUND_S, f"a gap of {max(gaps_s[2:]):.3f}s between tokens"
