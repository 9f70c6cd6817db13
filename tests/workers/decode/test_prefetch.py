"""D's prefetch reservations (workers/decode/prefetch.py) over the real seam: a NumpyRunner
engine and the fault pool. Exact block state for each way a reservation ends: adopted by its
decode (which reads only what the follow did not), refused over the bound or displaced there
by a more urgent one, a decode that comes while the prefetch still prepares, a release while
a copy is in flight, a prompt the decode's P tokenized otherwise."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import PrefetchRequest
from tests.wait import async_wait_until
from tests.workers.decode.test_decode_stages import (
    BS,
    NUM_BLOCKS,
    PROMPT,
    HeldGetPool,
    fill_pool,
    handle,
    idle,
    make_seam,
    read_events,
    request,
)
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import MODEL, numpy_engines, sample
from workers.decode.prefetch import Prefetches
from workers.decode.worker import start_decode
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.server.pd_worker import PDSeam

NUM_KEYS = 4  # PROMPT: 3 full blocks and a partial one


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


class HeldCpu:
    """The CPU threads, except that each job waits until `go` is set: a prefetch held in its
    prepare stage."""

    def __init__(self, cpu) -> None:
        self.cpu, self.go, self.waiting = cpu, asyncio.Event(), 0

    async def run(self, fn, *args):
        self.waiting += 1
        await self.go.wait()
        return await self.cpu.run(fn, *args)


def prefetch_request(
    prompt: list[int] = PROMPT, rid: str = "d1", priority: int = 0
) -> PrefetchRequest:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
            "priority": priority}  # fmt: skip
    return PrefetchRequest(request_id=rid, endpoint="completions", body=body)


def outcome(seam: PDSeam, name: str) -> float:
    return sample(seam, "pdworker_prefetch_total", outcome=name)


def reserved(seam: PDSeam) -> float:
    return sample(seam, "pdworker_prefetch_reserved_blocks")


def setup(engines, pool=None, **settings) -> tuple[PDSeam, Prefetches]:
    seam = make_seam(engines, pool, prefetch_poll_s=0.002, **settings)
    return seam, Prefetches(seam.server_metrics.registry)


async def test_the_decode_adopts_it_and_reads_only_what_the_follow_did_not(engines) -> None:
    seam, prefetches = setup(engines)
    llm = engines[1]
    fill_pool(seam, [0, 1])  # P's first chunk is written
    answer = await prefetches.reserve(seam, prefetch_request())
    assert (answer.num_prompt_tokens, answer.num_blocks_reserved) == (len(PROMPT), NUM_KEYS)
    assert (reserved(seam), llm.pool.num_used) == (NUM_KEYS, NUM_KEYS)
    await async_wait_until(lambda: ("get", 2) in seam.pool.calls, 5, "the first chunk read")
    fill_pool(seam, [2, 3])  # the rest, then P answers
    response = await start_decode(seam, request(handle(seam)), prefetches=prefetches)
    events = await read_events(response)
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert (events[-1].num_blocks_loaded, events[-1].num_blocks_loaded_ahead) == (4, 2)
    assert (outcome(seam, "adopted"), reserved(seam)) == (1, 0)
    assert sample(seam, "pdworker_prefetch_blocks_loaded_ahead_total") == 2
    await idle(llm)


async def test_over_the_bound_it_is_refused_and_takes_nothing(engines) -> None:
    seam, prefetches = setup(engines, prefetch_max_fraction=0.2)  # 3 of 16 blocks
    with pytest.raises(APIError) as refused:
        await prefetches.reserve(seam, prefetch_request())
    assert (refused.value.status, refused.value.code) == (503, "prefetch_full")
    assert (outcome(seam, "refused"), reserved(seam), engines[1].pool.num_used) == (1, 0, 0)


async def test_a_more_urgent_one_displaces_less_urgent_reservations_over_the_bound(
    engines,
) -> None:
    seam, prefetches = setup(engines, prefetch_max_fraction=0.5)  # 8 of 16: two prompts
    for rid in ("low-a", "low-b"):
        await prefetches.reserve(seam, prefetch_request(rid=rid, priority=5))
    await prefetches.reserve(seam, prefetch_request(rid="mid", priority=0))  # the newest low
    held = set(prefetches._held)
    assert (held, outcome(seam, "displaced"), reserved(seam)) == ({"low-a", "mid"}, 1, 8)
    await prefetches.reserve(seam, prefetch_request(rid="high", priority=-1))  # then low-a
    assert (set(prefetches._held), outcome(seam, "displaced")) == ({"mid", "high"}, 2)
    await prefetches.reserve(seam, prefetch_request(rid="high-2", priority=-1))  # then mid
    assert (set(prefetches._held), outcome(seam, "displaced")) == ({"high", "high-2"}, 3)
    for rid, priority in (("late-mid", 0), ("late-high", -1)):  # none less urgent than it
        with pytest.raises(APIError) as refused:
            await prefetches.reserve(seam, prefetch_request(rid=rid, priority=priority))
        assert refused.value.code == "prefetch_full"
    assert (reserved(seam), engines[1].pool.num_used, outcome(seam, "refused")) == (8, 8, 2)


async def test_a_decode_that_comes_while_it_prepares_frees_it_once_made(engines) -> None:
    seam, prefetches = setup(engines)
    cpu = HeldCpu(seam.cpu)
    seam = dataclasses.replace(seam, cpu=cpu)
    making = asyncio.ensure_future(prefetches.reserve(seam, prefetch_request()))
    await async_wait_until(lambda: cpu.waiting, 5, "the prefetch preparing")
    req = request(handle(seam))
    assert prefetches.take(seam, req, handle(seam).keys) is None  # the usual way, then
    cpu.go.set()
    answer = await making
    assert answer.num_blocks_reserved == NUM_KEYS  # taken, and given back at once
    assert (outcome(seam, "cancelled"), reserved(seam)) == (1, 0)
    await idle(engines[1])


@pytest.mark.parametrize("first", ["release", "decode"])
async def test_a_prefetch_that_comes_after_its_end_is_refused_and_takes_nothing(
    engines, first: str
) -> None:
    seam, prefetches = setup(engines)
    if first == "release":  # the router's DELETE overtook its own prefetch
        assert await prefetches.release(seam, "d1") is False
    else:  # the decode came first and loaded as usual
        assert prefetches.take(seam, request(handle(seam)), handle(seam).keys) is None
    with pytest.raises(APIError) as refused:
        await prefetches.reserve(seam, prefetch_request())
    assert (refused.value.status, refused.value.code) == (503, "prefetch_full")
    assert (outcome(seam, "refused"), reserved(seam), engines[1].pool.num_used) == (1, 0, 0)
    # Remembered once: the same id may prefetch again (a new request reusing it).
    answer = await prefetches.reserve(seam, prefetch_request())
    assert answer.num_blocks_reserved == NUM_KEYS
    assert await prefetches.release(seam, "d1") is True
    await idle(engines[1])


async def test_a_release_waits_for_the_copy_in_flight(engines) -> None:
    pool = HeldGetPool()
    seam, prefetches = setup(engines, pool)
    fill_pool(seam, [0, 1, 2, 3])
    await prefetches.reserve(seam, prefetch_request())
    assert await asyncio.to_thread(pool.get_started.wait, 5)
    follow = prefetches._held["d1"].follow
    releasing = asyncio.ensure_future(prefetches.release(seam, "d1"))
    # The release has told the follow to stop and waits for it to end.
    await async_wait_until(follow.stop.is_set, 5, "the release stopping the follow")
    # The get writes the reserved blocks: nothing is freed while it runs.
    assert not releasing.done() and engines[1].pool.num_used == NUM_KEYS
    pool.release.set()
    assert await releasing
    assert (outcome(seam, "cancelled"), reserved(seam)) == (1, 0)
    await idle(engines[1])


async def test_a_prompt_tokenized_otherwise_is_released_and_the_decode_loads(engines) -> None:
    seam, prefetches = setup(engines)
    other = [98] * len(PROMPT)
    await prefetches.reserve(seam, prefetch_request(other))
    fill_pool(seam, [0, 1, 2, 3])
    response = await start_decode(seam, request(handle(seam)), prefetches=prefetches)
    events = await read_events(response)
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert (events[-1].num_blocks_loaded, events[-1].num_blocks_loaded_ahead) == (4, None)
    await async_wait_until(lambda: outcome(seam, "mismatched"), 5, "the reservation released")
    assert reserved(seam) == 0
    await idle(engines[1])


async def test_a_decode_with_nothing_to_load_releases_it(engines) -> None:
    seam, prefetches = setup(engines)
    await prefetches.reserve(seam, prefetch_request())
    response = await start_decode(seam, request(None), prefetches=prefetches)
    events = await read_events(response)
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert events[-1].num_blocks_loaded_ahead is None
    await async_wait_until(lambda: outcome(seam, "cancelled"), 5, "the reservation released")
    assert (outcome(seam, "adopted"), reserved(seam)) == (0, 0)
    await idle(engines[1])
