"""The decode handler's stages (check handle, allocate, load, admit, stream) over the real seam:
a NumpyRunner engine (whose "KV" is the token ids) and the fault pool. Each error path with
its exact state: status, error code, Retry-After, the engine's blocks and the counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.requests import ClientDisconnect

from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import DecodeEvent, DecodeRequest, KVHandle, StageErrorBody
from tests.wait import async_wait_until
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import MODEL, block_value, numpy_engines, numpy_seam, sample
from workers.decode.worker import start_decode
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

BS = 4
NUM_BLOCKS = 16
PROMPT = [97 + (i * 3) % 26 for i in range(14)]  # 4 blocks, the last one partial
FIRST = reference_greedy(PROMPT, 1)[0]


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_seam(engines, **settings) -> PDSeam:
    pd = PDSettings(master_addr="f", metadata_url="f", wait_s=0.2, writeback=False, **settings)
    return numpy_seam(engines[0], pd, role="decode")


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
    response = await start_decode(seam, req)
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


async def test_a_stream_closed_before_the_engine_frees_its_blocks(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2, 3])
    response = await start_decode(seam, request(handle(seam)))
    assert engines[1].pool.num_used == 4  # loaded, not yet in the engine

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def gone(message: dict) -> None:  # the router left before the first event
        raise OSError("the router closed the connection")

    with pytest.raises(ClientDisconnect):
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, gone)
    await idle(engines[1])
