"""Decode's write-back (workers/handoff/writeback.py) over a real engine (the NumpyRunner
stand-in, whose "KV" is the token ids) and a fake pool: which keys are written with which
bytes, what is skipped, and that the blocks are referenced exactly while they are copied."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.wait import async_wait_until
from tests.workers.handoff.fake_pool import block_value, numpy_engines, numpy_seam
from workers.decode.stream import writeback_target
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.handoff.writeback import WriteBack
from workers.pool.keys import block_keys
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

BS = 4
NUM_BLOCKS = 32


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_ctx(engines) -> PDSeam:
    settings = PDSettings(master_addr="fake", metadata_url="fake")
    return numpy_seam(engines[0], settings, role="decode")


class SeamWriteBack:
    """A WriteBack as the decode role builds it, submitting to the seam's target."""

    def __init__(self, seam: PDSeam, max_in_flight: int) -> None:
        self.seam = seam
        self.wb = WriteBack(
            max_in_flight, seam.cache_metrics, seam.metrics.bytes_written, seam.background
        )

    @property
    def in_flight(self) -> int:
        return self.wb.in_flight

    def submit(self, request_id: str, tokens) -> bool:
        return self.wb.submit(writeback_target(self.seam), request_id, tokens)


def value(seam: PDSeam, name: str, **labels: str) -> float | None:
    return seam.server_metrics.registry.get_sample_value(name, labels)


async def finished_sequence(engine: AsyncEngine, rid: str, prompt: tuple[int, ...]) -> tuple:
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outs = [out async for out in engine.generate(EngineRequest(rid, prompt, params))]
    return prompt + tuple(t for out in outs for t in out.new_token_ids)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(97 + (i * 5 + offset) % 26 for i in range(n))


async def test_full_blocks_of_prompt_and_output_are_written_once(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = await finished_sequence(eng, "a", prompt(9))  # 14 tokens, KV for the first 13
    wb = SeamWriteBack(ctx, max_in_flight=4)
    assert wb.submit("a", tokens)
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    keys = block_keys(ctx.identity.fingerprint, list(tokens[:12]), BS)
    assert ctx.pool.store == {k: block_value(tokens[i * BS : (i + 1) * BS])
                              for i, k in enumerate(keys)}  # fmt: skip
    assert value(ctx, "pdworker_writeback_blocks_total") == 3
    assert ctx.pool.calls == [("exists", 3), ("put", 3)]
    assert wb.submit("a", tokens)  # again: everything is in the pool already
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    assert ctx.pool.calls[2:] == [("exists", 3)]
    llm.pool.check_integrity()
    assert llm.pool.num_used == 0 and wb.in_flight == 0


async def test_blocks_are_referenced_while_copied(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = await finished_sequence(eng, "a", prompt(9))
    assert llm.pool.num_used == 0
    seen: list[int] = []
    real_put = ctx.pool.put_from

    def put_from(keys, slots, staging=None):
        seen.append(llm.pool.num_used)  # during the copy: the write-back's references
        return real_put(keys, slots, staging=staging)

    ctx.pool.put_from = put_from  # type: ignore[method-assign]
    SeamWriteBack(ctx, max_in_flight=1).submit("a", tokens)
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    assert seen == [3] and llm.pool.num_used == 0


async def test_more_than_max_in_flight_are_skipped(engines) -> None:
    eng, _ = engines
    ctx = make_ctx(engines)
    a = await finished_sequence(eng, "a", prompt(9))
    b = await finished_sequence(eng, "b", prompt(9, 7))
    wb = SeamWriteBack(ctx, max_in_flight=1)
    assert wb.submit("a", a) and not wb.submit("b", b)
    assert value(ctx, "pdworker_writeback_skipped_total", reason="busy") == 1
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    assert len(ctx.pool.store) == 3  # a's blocks only


async def test_evicted_blocks_are_not_written(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = await finished_sequence(eng, "a", prompt(9))
    # Every block allocated by someone else evicts the cached ones (least recent first).
    taken = await eng.allocate_blocks(NUM_BLOCKS)
    eng.free_blocks(taken)
    SeamWriteBack(ctx, max_in_flight=1).submit("a", tokens)
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    assert ctx.pool.store == {} and ctx.pool.calls == []
    assert llm.pool.num_used == 0


async def test_a_failing_pool_skips_the_write_back_and_releases_its_references(engines) -> None:
    eng, llm = engines
    ctx = make_ctx(engines)
    tokens = await finished_sequence(eng, "a", prompt(9))

    def failing_put(keys) -> None:
        raise RuntimeError("fake: the pool owner died mid-put")

    ctx.pool.on_put = failing_put
    wb = SeamWriteBack(ctx, max_in_flight=1)
    assert wb.submit("a", tokens)
    await async_wait_until(lambda: not ctx.background, 10.0, "the write-back to end")
    assert value(ctx, "pdworker_writeback_skipped_total", reason="error") == 1
    assert value(ctx, "pdworker_writeback_blocks_total") == 0
    assert ctx.pool.store == {} and wb.in_flight == 0
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "the references to go back")
    llm.pool.check_integrity()
    assert ctx.pool.slots.num_free == 16  # the staging slots of the failed put came back
