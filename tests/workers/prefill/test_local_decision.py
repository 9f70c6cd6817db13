"""P's conditional disaggregation decision (workers/prefill/local_decision.py) over the real
seam: a NumpyRunner engine and the fault pool. The uncached count of each answer is exact,
and so is what the decision cost: pool calls made, blocks held, requests counted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdrouter.wire.pd import LocalPrefill, PrefillRequest, PrefillResult
from tests.wait import async_wait_until
from tests.workers.handoff.fake_pool import MODEL, block_value, numpy_engines, numpy_seam, sample
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.prefill.worker import run_prefill
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

BS = 4
NUM_BLOCKS = 16
PROMPT = [97 + (i * 3) % 26 for i in range(14)]  # 3 full blocks + 2 tokens
# A full hit covers the 3 full blocks (12 tokens): 2 tokens stay uncached at best.


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_seam(engines) -> PDSeam:
    pd = PDSettings(master_addr="f", metadata_url="f", wait_s=0.2, pool_prefix_min_tokens=4)
    return numpy_seam(engines[0], pd)


def request(rid: str, threshold: int) -> PrefillRequest:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    return PrefillRequest(request_id=rid, endpoint="completions", body=body,
                          local_prefill_below_tokens=threshold)  # fmt: skip


def fill_pool(seam: PDSeam, blocks: list[int]) -> None:
    keys = block_keys(seam.identity.fingerprint, PROMPT, BS)
    for i in blocks:
        seam.pool.store[keys[i]] = block_value(PROMPT[i * BS : (i + 1) * BS])


def exists_calls(seam: PDSeam) -> list[tuple[str, int]]:
    return [call for call in seam.pool.calls if call[0] == "exists"]


async def idle(llm: LLMEngine) -> None:
    await async_wait_until(lambda: llm.pool.num_used == 0, 5.0, "every block back")
    llm.pool.check_integrity()


async def test_a_prompt_shorter_than_the_threshold_is_left_to_decode_without_a_look(
    engines,
) -> None:
    seam = make_seam(engines)
    answer = await run_prefill(seam, request("p1", threshold=15), "p1")
    assert answer == LocalPrefill(request_id="p1", prompt_token_ids=PROMPT,
                                  num_uncached_tokens=14, threshold_tokens=15)  # fmt: skip
    assert seam.pool.calls == [] and seam.pool.store == {}
    assert engines[1].pool.num_used == 0
    assert sample(seam, "pdworker_requests_total", endpoint="prefill", status="success") == 0


async def test_a_pool_hit_leaves_a_short_suffix_to_decode(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2])
    answer = await run_prefill(seam, request("p1", threshold=3), "p1")
    assert isinstance(answer, LocalPrefill) and answer.num_uncached_tokens == 2
    assert exists_calls(seam) == [("exists", 3)]  # one lookup, nothing loaded
    assert [c for c in seam.pool.calls if c[0] != "exists"] == []
    await idle(engines[1])


async def test_a_partial_pool_hit_over_the_threshold_is_prefilled_here(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 2])  # the hole at block 1 ends the hit: 10 tokens uncached
    answer = await run_prefill(seam, request("p1", threshold=8), "p1")
    assert isinstance(answer, PrefillResult) and answer.kv is not None
    assert answer.num_pool_cached_tokens == 4  # the lease loads the one-block hit
    # The decision's lookup, the lease's, the write's.
    assert exists_calls(seam) == [("exists", 3), ("exists", 3), ("exists", 4)]
    await idle(engines[1])


async def test_a_device_hit_decides_without_the_pool(engines) -> None:
    seam = make_seam(engines)
    first = await run_prefill(seam, request("p1", threshold=0), "p1")
    assert isinstance(first, PrefillResult)  # 0: never local; its blocks stay cached
    seam.pool.store.clear()
    seam.pool.calls.clear()
    answer = await run_prefill(seam, request("p2", threshold=3), "p2")
    assert isinstance(answer, LocalPrefill) and answer.num_uncached_tokens == 2
    assert seam.pool.calls == []
    await idle(engines[1])


async def test_a_suffix_no_hit_can_shorten_skips_the_decision(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2])
    answer = await run_prefill(seam, request("p1", threshold=2), "p1")
    assert isinstance(answer, PrefillResult)  # 2 uncached at best: not below 2
    assert exists_calls(seam) == [("exists", 3), ("exists", 4)]  # the lease's, the write's
    await idle(engines[1])


async def test_a_failing_pool_lookup_prefills_here(engines) -> None:
    seam = make_seam(engines)
    fill_pool(seam, [0, 1, 2])
    seam.pool.exists_error = True
    answer = await run_prefill(seam, request("p1", threshold=3), "p1")
    assert isinstance(answer, PrefillResult) and answer.num_cached_tokens == 0
    await idle(engines[1])
