"""P writes a chunked prompt's blocks while its later chunks compute (run_prefill with
ChunkedWrite), over a real engine (the NumpyRunner stand-in, whose "KV" is the token ids) and
the fake pool: the write of chunk 0's blocks happens while chunk 1 is being computed, every
block lands exactly, and a cancelled prefill frees its blocks only after the put reading them
has returned."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from pdrouter.wire.pd import PrefillRequest
from tests.wait import async_wait_until
from tests.workers.engine.numpy_runner import EMPTY, NumpyRunner
from tests.workers.handoff.fake_pool import block_value, numpy_engines, numpy_seam
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.prefill.worker import run_prefill
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

BS = 4
NUM_BLOCKS = 32
CHUNK = 8  # max_num_batched_tokens: a 30-token prompt is chunks of 8, 8, 8 and 6 tokens
PROMPT = [97 + (i * 7) % 26 for i in range(30)]
NUM_EARLY = 6  # full blocks of the first three chunks, reported before the last one
GATE_S = 10.0


class GatedRunner(NumpyRunner):
    """Holds its second step (chunk 1) until `release` is set: a write of chunk 0's blocks
    that only starts after the prefill cannot set it, and the step records that it waited
    in vain."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.release = threading.Event()
        self.released_in_time: bool | None = None

    def run(self, batch):
        if self.num_runs == 1:
            self.released_in_time = self.release.wait(GATE_S)
        return super().run(batch)


@pytest.fixture
def runner() -> GatedRunner:
    return GatedRunner(NUM_BLOCKS, BS)


@pytest.fixture
def engines(runner: GatedRunner) -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS, max_num_batched_tokens=CHUNK, runner=runner)


def make_ctx(engines, write_while_computing: bool = True) -> PDSeam:
    settings = PDSettings(
        master_addr="fake",
        metadata_url="fake",
        transfer_batch_blocks=2,
        num_staging_slots=16,
        pool_prefix=False,
        write_while_computing=write_while_computing,
    )
    return numpy_seam(engines[0], settings)


def prefill_request(rid: str) -> PrefillRequest:
    body = {"model": "numpy-stand-in", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return PrefillRequest(request_id=rid, endpoint="completions", body=body)


def expected_pool(ctx: PDSeam) -> dict[str, bytes]:
    """Each block's tokens; the partial last one padded with never-written positions."""
    keys = block_keys(ctx.identity.fingerprint, PROMPT, BS)
    padded = PROMPT + [EMPTY] * (-len(PROMPT) % BS)
    return {key: block_value(padded[i * BS : (i + 1) * BS]) for i, key in enumerate(keys)}


def early_blocks(ctx: PDSeam) -> float:
    return (
        ctx.server_metrics.registry.get_sample_value("pdworker_pool_blocks_written_early_total")
        or 0.0
    )


async def test_chunk_blocks_are_put_while_the_next_chunk_computes(engines, runner) -> None:
    ctx = make_ctx(engines)
    puts: list[tuple[int, bool]] = []  # (keys, was the prefill still computing?)

    def on_put(keys) -> None:
        puts.append((len(keys), not runner.release.is_set()))
        runner.release.set()  # chunk 1 may compute now: chunk 0's blocks are being put

    ctx.pool.on_put = on_put
    result = await run_prefill(ctx, prefill_request("r1"), "r1")
    assert runner.released_in_time is True  # the put came while step 2 was held
    assert puts[0] == (2, True)  # chunk 0's two blocks, put during the prefill
    assert ctx.pool.store == expected_pool(ctx)  # every block, byte for byte
    assert (result.num_blocks_written, result.num_blocks_skipped) == (8, 0)
    assert early_blocks(ctx) == NUM_EARLY
    llm = engines[1]
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "the blocks and pins to go back")
    assert llm.scheduler.pins == {}


async def test_without_it_every_block_waits_for_the_prefill(engines, runner) -> None:
    ctx = make_ctx(engines, write_while_computing=False)
    runner.release.set()  # nothing to wait for: no write can start before the end
    ctx.pool.on_put = lambda keys: None
    result = await run_prefill(ctx, prefill_request("r2"), "r2")
    assert ctx.pool.store == expected_pool(ctx)
    assert result.num_blocks_written == 8 and early_blocks(ctx) == 0
    assert ctx.pool.calls.count(("put", 2)) == 4  # four groups of 2, all after the prefill


async def test_a_cancelled_prefill_frees_its_blocks_after_the_put_reading_them(
    engines, runner
) -> None:
    ctx = make_ctx(engines)
    eng, llm = engines
    order: list[str] = []
    put_started, put_may_return = threading.Event(), threading.Event()

    def slow_put(keys) -> None:  # the cancel lands inside this put
        put_started.set()
        assert put_may_return.wait(GATE_S), "the test never let the put return"
        order.append("put returned")

    ctx.pool.on_put = slow_put
    release = eng.release

    def recording_release(request_id: str) -> None:
        order.append("release")
        release(request_id)

    eng.release = recording_release  # type: ignore[method-assign]
    abort_posted = threading.Event()
    post = eng._post

    def recording_post(kind: str, arg) -> None:
        if kind == "abort_stream":
            abort_posted.set()
        post(kind, arg)

    eng._post = recording_post  # type: ignore[method-assign]
    task = asyncio.ensure_future(run_prefill(ctx, prefill_request("r3"), "r3"))
    await async_wait_until(put_started.is_set, 5.0, "the first chunk's put to start")
    task.cancel()
    # Chunk 1 computes only once the abort is in the engine's inbox: released any earlier,
    # the engine could finish the prefill before the cancellation reached the task (then
    # nothing is left to abort, and the request is held until its release).
    await async_wait_until(abort_posted.is_set, 5.0, "the closed stream's abort")
    runner.release.set()
    await async_wait_until(lambda: "r3" not in llm.scheduler.requests, 5.0, "the abort")
    assert order == [] and not task.done()  # aborted, the put still running: blocks kept
    put_may_return.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert order == ["put returned", "release"]
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "the blocks and pins to go back")
    assert llm.scheduler.pins == {}
