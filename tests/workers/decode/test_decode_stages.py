"""The decode handler's stages (check handle, allocate, load, admit, stream) over the real seam:
a NumpyRunner engine (whose "KV" is the token ids) and the fault pool. Each error path with
its exact state: status, error code, Retry-After, the engine's blocks and the counters.

The tests of a request id the engine holds and of a client gone early run on a StepGate
engine, whose steps run only when the test allows them: the numpy model would otherwise
finish a whole request before the test's next line."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence

import pytest
from starlette.requests import ClientDisconnect

from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import DecodeEvent, DecodeRequest, DecodeSequence, KVHandle, StageErrorBody
from tests.wait import async_wait_until
from tests.workers.decode.step_gate import BS, GATE_S, NUM_BLOCKS
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import (
    MODEL,
    FakePool,
    block_value,
    numpy_engines,
    numpy_seam,
    sample,
)
from workers.decode.worker import start_decode
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

PROMPT = [97 + (i * 3) % 26 for i in range(14)]  # 4 blocks, the last one partial
FIRST = reference_greedy(PROMPT, 1)[0]


class HeldGetPool(FakePool):
    """The fault pool whose first get waits until `release` is set."""

    def __init__(self) -> None:
        super().__init__(BS)
        self.release = threading.Event()
        self._first = True

    def get_into(self, keys: Sequence[str], slots: Sequence[int], staging=None):
        if self._first:
            self._first = False
            self.get_started.set()
            assert self.release.wait(GATE_S), "the test never released the first get"
        return super().get_into(keys, slots, staging)


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_seam(engines, pool: FakePool | None = None, **settings) -> PDSeam:
    pd = PDSettings(master_addr="f", metadata_url="f", wait_s=0.2, writeback=False, **settings)
    return numpy_seam(engines[0], pd, role="decode", pool=pool)


def requests_total(seam: PDSeam, status: str) -> float:
    return sample(seam, "pdworker_requests_total", endpoint="decode", status=status)


def handle(seam: PDSeam, **changes) -> KVHandle:
    fields = {
        "fingerprint": seam.identity.fingerprint,
        "block_size": BS,
        "num_tokens": len(PROMPT),
        "keys": block_keys(seam.identity.fingerprint, PROMPT, BS),
    }
    return KVHandle(**{**fields, **changes})


def request(kv: KVHandle | None, policy: str | None = None, rid: str = "d1") -> DecodeRequest:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    return DecodeRequest(
        request_id=rid,
        endpoint="completions",
        body=body,
        prompt_token_ids=PROMPT,
        output_token_ids=[FIRST],
        kv=kv,
        missing_kv_policy=policy,
    )


def fill_pool(seam: PDSeam, blocks: list[int]) -> None:
    """The prompt's blocks as P would have put them (the partial one padded as P's cache)."""
    padded = PROMPT + [-1] * (-len(PROMPT) % BS)
    keys = block_keys(seam.identity.fingerprint, PROMPT, BS)
    for i in blocks:
        seam.pool.store[keys[i]] = block_value(padded[i * BS : (i + 1) * BS])


async def answer(seam: PDSeam, req: DecodeRequest) -> list[DecodeEvent]:
    return await read_events(await start_decode(seam, req))


async def read_events(response) -> list[DecodeEvent]:
    events = []
    async for chunk in response.body_iterator:
        data = chunk.decode() if isinstance(chunk, bytes) else chunk
        assert data.startswith("data: "), data
        events.append(DecodeEvent.model_validate_json(data[len("data: ") :]))
    return events


async def idle(llm: LLMEngine) -> None:
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "every block back")
    llm.pool.check_integrity()


async def test_the_whole_prompt_from_the_pool(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    events = await answer(seam, request(handle(seam)))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == reference_greedy(PROMPT, 5)[1:]
    final = events[-1]
    assert (final.finish_reason, final.num_blocks_loaded, final.num_tokens_recomputed) == (
        "length",
        4,
        0,
    )
    assert final.num_bytes_read == 4 * seam.pool.config.slot_bytes
    assert sample(seam, "pdworker_pool_blocks_loaded_total") == 4
    await idle(engines[1])


async def test_missing_blocks_are_recomputed_and_the_unfilled_ones_freed(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 2, 3])  # a hole at block 1: reading stops there
    events = await answer(seam, request(handle(seam), "recompute"))
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert (events[-1].num_blocks_loaded, events[-1].num_tokens_recomputed) == (1, 10)
    assert sample(seam, "pdworker_pool_blocks_missing_total") == 3
    assert sample(seam, "pdworker_prompt_tokens_recomputed_total") == 10
    await idle(engines[1])


async def test_missing_blocks_under_policy_fail_are_a_502_naming_them(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0])
    response = await start_decode(seam, request(handle(seam), "fail"))
    assert response.status_code == 502
    error = StageErrorBody.model_validate_json(response.body).error
    keys = block_keys(seam.identity.fingerprint, PROMPT, BS)
    assert error.missing_keys == keys[1:]  # the group where reading stopped (group of 64)
    assert "3 of 4 KV blocks could not be read" in error.message
    assert sample(seam, "pdworker_pool_blocks_missing_total") == 3
    await idle(engines[1])


async def test_a_handle_of_another_fingerprint_is_a_400_before_any_block(engines) -> None:
    seam = make_seam(engines)
    with pytest.raises(APIError) as caught:
        await start_decode(seam, request(handle(seam, fingerprint="fp-other")))
    assert (caught.value.status, caught.value.param) == (400, "kv")
    assert "fp-other" in caught.value.message
    with pytest.raises(APIError) as caught:
        await start_decode(seam, request(handle(seam, block_size=8)))
    assert (caught.value.status, caught.value.param) == (400, "kv")
    with pytest.raises(APIError, match="do not match prompt_token_ids"):
        await start_decode(seam, request(handle(seam, num_tokens=13)))
    assert engines[1].pool.num_used == 0 and seam.pool.calls == []


async def test_no_free_kv_blocks_is_a_503_kv_full_with_retry_after(engines) -> None:
    eng, llm = engines
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    held = await eng.allocate_blocks(NUM_BLOCKS - 2)  # 2 free, the prompt needs 4
    with pytest.raises(APIError) as caught:
        await start_decode(seam, request(handle(seam)))
    assert (caught.value.status, caught.value.code) == (503, "kv_full")
    assert caught.value.headers() == {"Retry-After": "1"}
    assert llm.pool.num_used == NUM_BLOCKS - 2 and seam.pool.calls == []
    eng.free_blocks(held)
    await idle(llm)


async def test_no_free_staging_slot_is_a_503_staging_full_and_the_blocks_go_back(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    taken = seam.pool.slots.allocate(16)  # every staging slot busy with other transfers
    with pytest.raises(APIError) as caught:
        await start_decode(seam, request(handle(seam)))
    assert (caught.value.status, caught.value.code) == (503, "staging_full")
    assert caught.value.headers() == {"Retry-After": "1"}
    await idle(engines[1])  # the 4 allocated blocks were freed
    seam.pool.slots.free(taken)


def assert_as_alone(events: list[DecodeEvent], seam: PDSeam) -> None:
    """The answer of the whole prompt loaded from the pool, as when it runs alone."""
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    final = events[-1]
    assert (final.finish_reason, final.num_blocks_loaded, final.num_tokens_recomputed) == (
        "length",
        4,
        0,
    )
    assert final.num_bytes_read == 4 * seam.pool.config.slot_bytes


async def test_an_id_still_decoding_is_a_400_and_that_request_goes_on(gated, gate) -> None:
    llm = gated[1]
    seam = make_seam(gated, pool=HeldGetPool())
    fill_pool(seam, [0, 1, 2, 3])
    # The twin allocates its blocks and starts loading them; its load waits while d1 runs.
    twin = asyncio.create_task(start_decode(seam, request(handle(seam))))
    await async_wait_until(seam.pool.get_started.is_set, 5.0, "the twin's load")
    gate.allow(1)  # d1's first output; its next step waits
    first = await start_decode(seam, request(handle(seam)))
    seam.pool.release.set()
    with pytest.raises(APIError) as caught:
        await twin
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "request_id",
        "duplicate_request_id",
    )
    assert gate.num_runs == 1 and list(llm.scheduler.requests) == ["d1"]
    gate.open()
    assert_as_alone(await read_events(first), seam)
    assert (requests_total(seam, "success"), requests_total(seam, "error")) == (1, 1)
    assert sample(seam, "pdworker_pool_blocks_loaded_total") == 8  # both loaded 4
    await idle(llm)  # the twin's 4 blocks went back, and d1's after it


async def test_an_id_held_by_a_finished_request_is_a_400_and_it_stays_held(engines) -> None:
    eng, llm = engines
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    params = SamplingParams(max_tokens=5, temperature=0.0)
    held = [o async for o in eng.generate(EngineRequest("d1", (97, 98, 99, 100, 101), params,
                                                        prefill_only=True))]  # fmt: skip
    assert held[-1].block_ids == (0, 1) and llm.pool.num_used == 2
    with pytest.raises(APIError) as caught:  # refused by the engine thread
        await start_decode(seam, request(handle(seam)))
    assert (caught.value.status, caught.value.code) == (400, "duplicate_request_id")
    assert requests_total(seam, "error") == 1
    # One round trip through the engine's inbox: D's 4 blocks were freed before it.
    barrier = await eng.allocate_blocks(1)
    assert llm.pool.num_used == 3 and llm.scheduler.held.keys() == {"d1"}
    eng.free_blocks(barrier)
    eng.release("d1")
    await idle(llm)


async def disconnect(response) -> None:
    """Run the response for a router that left before the first event."""

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def gone(message: dict) -> None:
        raise OSError("the router closed the connection")

    with pytest.raises(ClientDisconnect):
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, gone)


async def test_a_stream_never_read_aborts_the_request(gated, gate) -> None:
    llm = gated[1]
    seam = make_seam(gated)
    fill_pool(seam, [0, 1, 2, 3])
    gate.allow(1)
    response = await start_decode(seam, request(handle(seam)))  # the first output is in
    await async_wait_until(lambda: gate.num_entered == 2, 5.0, "the second step to wait")
    assert llm.pool.num_used == 4
    await disconnect(response)
    gate.open()
    await idle(llm)
    assert gate.num_runs == 2  # aborted before the third of the 4 steps it needed
    assert (requests_total(seam, "aborted"), requests_total(seam, "success")) == (1, 0)


async def test_a_router_gone_before_the_first_output_aborts_the_request(gated, gate) -> None:
    llm = gated[1]
    seam = make_seam(gated)
    fill_pool(seam, [0, 1, 2, 3])
    admitted = asyncio.create_task(start_decode(seam, request(handle(seam))))
    await async_wait_until(lambda: gate.num_entered == 1, 5.0, "the first step to wait")
    admitted.cancel()  # what unless_disconnected does when the router leaves
    with pytest.raises(asyncio.CancelledError):
        await admitted
    gate.open()
    await idle(llm)
    assert gate.num_runs == 1
    assert requests_total(seam, "aborted") == 1


async def test_a_group_loads_the_prompt_once_and_streams_each_sequence(engines) -> None:
    """Sequences 0, 2 and 3 of a request (P's first tokens differ): one load of the prompt's
    4 blocks, the group forked at its end, each sequence's events named by its index."""
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    firsts = {0: FIRST, 2: 40, 3: 41}
    req = request(handle(seam)).model_copy(update={"sequences": [
        DecodeSequence(index=j, output_token_ids=[t]) for j, t in firsts.items()
    ]})  # fmt: skip
    events = await answer(seam, req)
    for j, first in firsts.items():
        mine = [e for e in events if e.index == j]
        assert [t for e in mine for t in e.token_ids] == reference_greedy([*PROMPT, first], 4)
        assert mine[-1].finished and [e.finished for e in mine[:-1]] == [False] * 3
    assert [e.more for e in events if e.finished] == [True, True, False]
    assert sample(seam, "pdworker_pool_blocks_loaded_total") == 4
    await idle(engines[1])
