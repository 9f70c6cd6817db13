"""D's allocation by priority, over the real seam (NumpyRunner engine, fault pool): a decode
request more urgent than the running ones gets its blocks by preempting the least urgent, whose
stream resumes intact; a less urgent one preempts nothing and waits for blocks to free."""

from __future__ import annotations

import asyncio

from tests.wait import async_wait_until
from tests.workers.decode.step_gate import StepGate
from tests.workers.decode.test_decode_stages import (
    PROMPT,
    fill_pool,
    handle,
    idle,
    make_seam,
    read_events,
    request,
)
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import numpy_seam
from workers.decode.worker import start_decode
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.server.config import PDSettings

LOW_IDS = ("low1", "low2")

# 7 blocks each with its first output. Two prompts that share no block: with one, a low that
# the engine admitted a step after the other (its post came late) shared the first's cached
# blocks, and the two held 8 blocks rather than 14 (seen once in a full run).
LOW_PROMPTS = {rid: [97 + (i * 5 + k) % 26 for i in range(26)] for k, rid in enumerate(LOW_IDS)}


async def drain(stream) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]


async def start_lows(eng: AsyncEngine, llm: LLMEngine, gate: StepGate) -> list[asyncio.Task]:
    """Two low-priority requests running, holding 14 of the 16 blocks."""
    params = SamplingParams(max_tokens=6, temperature=0.0, priority=5)
    lows = [asyncio.ensure_future(drain(eng.generate(EngineRequest(rid, tuple(LOW_PROMPTS[rid]),
            params)))) for rid in LOW_IDS]  # fmt: skip
    # One step admits and prefills both; a low posted late is admitted by the next step, which
    # takes its blocks before it waits at the gate: 14 held either way.
    gate.allow(1)
    await async_wait_until(lambda: llm.pool.num_free == 2, 5.0, "both lows running")
    return lows


def low_answers() -> list[list[int]]:
    return [reference_greedy(LOW_PROMPTS[rid], 6) for rid in LOW_IDS]


async def posted_call(eng: AsyncEngine) -> None:
    """Until a block call waits in the engine's inbox (the engine thread is held in a step)."""
    await async_wait_until(
        lambda: any(kind == "call" for kind, _ in eng._inbox), 5.0, "the allocation posted"
    )


async def test_an_urgent_decode_takes_the_blocks_of_the_newest_low_request(gated, gate) -> None:
    eng, llm = gated
    seam = make_seam(gated)
    fill_pool(seam, [0, 1, 2, 3])
    lows = await start_lows(eng, llm, gate)
    req = request(handle(seam))
    req.body["priority"] = -1
    response = asyncio.ensure_future(start_decode(seam, req))
    await posted_call(eng)  # the allocation, applied after the step the gate holds
    gate.allow(1)
    await async_wait_until(lambda: llm.scheduler.num_preemptions_total == 1, 5.0, "preempted")
    assert llm.scheduler.requests["low2"].num_preemptions == 1  # the newest of the two
    gate.open()
    events = await read_events(await response)
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert await asyncio.gather(*lows) == low_answers()  # low2 resumed intact
    assert llm.scheduler.num_preemptions_total == 1
    await idle(llm)


async def test_a_less_urgent_decode_preempts_nothing_and_waits_for_blocks(gated, gate) -> None:
    eng, llm = gated
    settings = PDSettings(master_addr="f", metadata_url="f", wait_s=30.0, writeback=False)
    seam = numpy_seam(eng, settings, role="decode")
    fill_pool(seam, [0, 1, 2, 3])
    lows = await start_lows(eng, llm, gate)
    req = request(handle(seam))
    req.body["priority"] = 9
    response = asyncio.ensure_future(start_decode(seam, req))
    await posted_call(eng)
    num_steps = gate.num_entered
    gate.allow(1)  # the allocation, applied before the next step, finds 2 free blocks
    await async_wait_until(lambda: gate.num_entered > num_steps, 5.0, "the next step")
    assert llm.scheduler.num_preemptions_total == 0 and llm.pool.num_free == 2
    gate.open()  # the lows end and free their blocks: then it gets them
    events = await read_events(await response)
    assert [t for e in events for t in e.token_ids] == reference_greedy(PROMPT, 5)[1:]
    assert await asyncio.gather(*lows) == low_answers()
    assert llm.scheduler.num_preemptions_total == 0
    await idle(llm)
