"""The prefill handler's stages (prepare, lease, generate, write, result) over the real seam: a
NumpyRunner engine (whose "KV" is the token ids) and the fault pool. Each error path with its
exact state: status, error code, Retry-After, the engine's blocks and the counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdrouter.wire.choices import choice_seed
from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import PrefillRequest
from tests.wait import async_wait_until
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import MODEL, numpy_engines, numpy_seam, sample
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.prefill.worker import run_prefill
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

BS = 4
NUM_BLOCKS = 16
PROMPT = [97 + (i * 3) % 26 for i in range(14)]  # 4 blocks, the last one partial


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_seam(engines, **settings) -> PDSeam:
    pd = PDSettings(master_addr="f", metadata_url="f", wait_s=0.2, **settings)
    return numpy_seam(engines[0], pd)


def request(rid: str, **body) -> PrefillRequest:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **body}
    return PrefillRequest(request_id=rid, endpoint="completions", body=body)


def requests_total(seam: PDSeam, status: str) -> float:
    return sample(seam, "pdworker_requests_total", endpoint="prefill", status=status)


async def idle(llm: LLMEngine) -> None:
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "every block back")
    llm.pool.check_integrity()


async def test_a_prefill_writes_every_block_and_hands_over_the_keys(engines) -> None:
    seam = make_seam(engines)
    result = await run_prefill(seam, request("p1"), "p1")
    keys = block_keys(seam.identity.fingerprint, PROMPT, BS)
    assert result.first_token_id == reference_greedy(PROMPT, 1)[0]
    assert result.kv is not None and result.kv.keys == keys and result.finish_reason is None
    assert (result.num_blocks_written, result.num_blocks_skipped) == (4, 0)
    assert sorted(seam.pool.store) == sorted(keys)
    t = result.timings
    assert t.d2h_s > 0 and t.put_s > 0
    # The engine's queue, then its compute, within P's own part up to the first token.
    assert t.engine_queue_s >= 0 and t.engine_compute_s > 0
    assert t.engine_queue_s + t.engine_compute_s <= t.queue_compute_s
    assert requests_total(seam, "success") == 1
    await idle(engines[1])


async def test_a_first_token_that_ends_the_request_writes_nothing(engines) -> None:
    seam = make_seam(engines)
    result = await run_prefill(seam, request("p1", max_tokens=1), "p1")
    assert (result.finish_reason, result.kv, result.num_blocks_written) == ("length", None, 0)
    assert seam.pool.store == {}
    await idle(engines[1])


async def test_an_id_the_engine_holds_is_a_400_and_its_blocks_stay(engines) -> None:
    eng, llm = engines
    seam = make_seam(engines)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    held = [o async for o in eng.generate(EngineRequest("dup", (97, 98, 99, 100, 101), params,
                                                        prefill_only=True))]  # fmt: skip
    assert held[-1].block_ids == (0, 1) and llm.pool.num_used == 2
    with pytest.raises(APIError) as caught:  # refused by the engine thread
        await run_prefill(seam, request("dup"), "dup")
    assert (caught.value.status, caught.value.code) == (400, "duplicate_request_id")
    assert (caught.value.param, requests_total(seam, "error")) == ("request_id", 1)
    # One round trip through the engine's inbox: a release posted before it has been applied.
    barrier = await eng.allocate_blocks(1)
    assert llm.pool.num_used == 3 and "dup" in llm.scheduler.requests  # "dup" untouched
    eng.free_blocks(barrier)
    eng.release("dup")
    await idle(llm)


async def test_an_id_still_generating_is_a_400_and_that_request_goes_on(engines) -> None:
    eng, llm = engines
    seam = make_seam(engines)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    all_blocks = await eng.allocate_blocks(NUM_BLOCKS)  # "live" waits for blocks: it stays
    running = eng.generate(EngineRequest("live", tuple(PROMPT), params))
    await async_wait_until(lambda: eng.stats().num_waiting == 1, 5.0, "live to wait")
    with pytest.raises(APIError) as caught:  # refused at the call
        await run_prefill(seam, request("live"), "live")
    assert (caught.value.status, caught.value.code) == (400, "duplicate_request_id")
    assert llm.pool.num_used == NUM_BLOCKS
    eng.free_blocks(all_blocks)
    outputs = [o async for o in running]
    assert [t for o in outputs for t in o.new_token_ids] == reference_greedy(PROMPT, 5)
    await idle(llm)


async def test_no_free_staging_slot_is_a_503_staging_full_and_the_blocks_go_back(engines) -> None:
    seam = make_seam(engines)
    taken = seam.pool.slots.allocate(16)  # every staging slot busy with other transfers
    with pytest.raises(APIError) as caught:
        await run_prefill(seam, request("p1"), "p1")
    assert (caught.value.status, caught.value.code) == (503, "staging_full")
    assert caught.value.headers() == {"Retry-After": "1"}
    assert requests_total(seam, "error") == 1 and seam.pool.store == {}
    await idle(engines[1])
    seam.pool.slots.free(taken)


async def test_a_closed_pool_is_a_503_before_the_engine_is_asked(engines) -> None:
    seam = make_seam(engines)
    seam.pool.is_open = False
    with pytest.raises(APIError) as caught:
        await run_prefill(seam, request("p1"), "p1")
    assert (caught.value.status, caught.value.code) == (503, "pool_unavailable")
    assert engines[1].runner.num_runs == 0


async def test_bad_input_is_a_400_before_the_engine_is_asked(engines) -> None:
    seam = make_seam(engines)
    with pytest.raises(APIError) as caught:
        await run_prefill(seam, request("p1", max_tokens=60), "p1")  # 14 + 60 > 64
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    with pytest.raises(APIError) as caught:
        await run_prefill(seam, request("p1", model="other"), "p1")
    assert (caught.value.status, caught.value.code) == (400, "model_not_found")
    assert engines[1].runner.num_runs == 0


async def test_a_group_prefills_once_and_answers_every_first_token(engines) -> None:
    """n=3, seeded: one prompt computed and written once, three first tokens, each the one a
    request of that sequence's seed samples (choice_seed)."""
    seam = make_seam(engines)
    body = {"n": 3, "seed": 5, "temperature": 1.0}
    result = await run_prefill(seam, request("g", **body), "g")
    firsts = [t.token_id for t in result.first_tokens()]
    separate = []
    for j in range(3):
        one = request(f"s{j}", seed=choice_seed(5, j), temperature=1.0)
        separate.append((await run_prefill(seam, one, f"s{j}")).first_token_id)
    assert firsts == separate and len(result.sequences) == 2
    assert all(t.logprobs is None and t.finish_reason is None for t in result.sequences)
    assert result.num_blocks_written == 4  # the separate requests found them: skipped
    assert sample(seam, "pdworker_prompt_tokens_by_source_total", source="computed") >= 14
    await idle(engines[1])
