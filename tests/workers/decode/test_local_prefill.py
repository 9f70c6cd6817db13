"""D prefilling a prompt itself (no KV handle: workers/decode/local_prefill.py) over the real
seam: a NumpyRunner engine and the fault pool. The tokens equal a mixed run's from the first
on, and the final event says exactly which prompt tokens came from a cache, and which cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from pdrouter.wire.pd import DecodeRequest
from tests.workers.decode.test_decode_stages import (
    BS,
    NUM_BLOCKS,
    PROMPT,
    handle,
    idle,
    request,
)
from tests.workers.decode.test_decode_stages import answer as decode_answer
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.handoff.fake_pool import block_value, numpy_engines, numpy_seam, sample
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.pool.keys import block_keys
from workers.server.config import PDSettings
from workers.server.pd_worker import PDSeam

REFERENCE = reference_greedy(PROMPT, 5)
SOURCES = "pdworker_prompt_tokens_by_source_total"


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    yield from numpy_engines(BS, NUM_BLOCKS)


def make_seam(engines, **settings) -> PDSeam:
    pd = PDSettings(master_addr="f", metadata_url="f", wait_s=0.2, writeback=False,
                    pool_prefix_min_tokens=4, **settings)  # fmt: skip
    return numpy_seam(engines[0], pd, role="decode")


def local_request(rid: str = "d1", output_token_ids: list[int] | None = None) -> DecodeRequest:
    """The decode request of a prompt P left to D: no handle, no first token (a resume: the
    tokens sent so far)."""
    return request(None, rid=rid).model_copy(update={"output_token_ids": output_token_ids or []})


def sources(seam: PDSeam) -> dict[str, float]:
    names = ("device", "pool", "computed", "handoff")
    return {n: sample(seam, SOURCES, source=n) for n in names}


async def test_a_cold_prompt_is_computed_and_the_first_token_is_d_s(engines) -> None:
    seam = make_seam(engines)
    events = await decode_answer(seam, local_request())
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert events[0].token_ids == REFERENCE[:1]  # the first event is the first token
    final = events[-1]
    assert (final.num_cached_tokens, final.num_pool_cached_tokens) == (0, 0)
    assert (final.num_blocks_loaded, final.num_tokens_recomputed) == (0, 0)
    assert sources(seam) == {"device": 0, "pool": 0, "computed": 14, "handoff": 0}
    assert seam.pool.calls == [("exists", 3)]  # the prefix lookup found nothing
    await idle(engines[1])


async def test_the_pool_s_prefix_is_read_and_counted_as_cached(engines) -> None:
    seam = make_seam(engines)
    keys = block_keys(seam.identity.fingerprint, PROMPT, BS)
    for i in range(3):  # the full blocks, as P or a write-back put them
        seam.pool.store[keys[i]] = block_value(PROMPT[i * BS : (i + 1) * BS])
    events = await decode_answer(seam, local_request())
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert (events[-1].num_cached_tokens, events[-1].num_pool_cached_tokens) == (12, 12)
    assert sources(seam) == {"device": 0, "pool": 12, "computed": 2, "handoff": 0}
    await idle(engines[1])


async def test_the_device_cache_serves_the_next_request_of_the_prompt(engines) -> None:
    seam = make_seam(engines)
    await decode_answer(seam, local_request("d1"))
    events = await decode_answer(seam, local_request("d2"))
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert (events[-1].num_cached_tokens, events[-1].num_pool_cached_tokens) == (12, 0)
    assert sources(seam) == {"device": 12, "pool": 0, "computed": 14 + 2, "handoff": 0}
    await idle(engines[1])


async def test_a_resume_without_a_handle_continues_after_the_tokens_sent(engines) -> None:
    seam = make_seam(engines)
    events = await decode_answer(seam, local_request(output_token_ids=REFERENCE[:2]))
    assert [t for e in events for t in e.token_ids] == REFERENCE[2:]
    assert events[-1].num_output_tokens == 5
    await idle(engines[1])


async def test_without_the_pool_prefix_cache_only_the_device_is_used(engines) -> None:
    seam = make_seam(engines, pool_prefix=False)
    events = await decode_answer(seam, local_request())
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert seam.pool.calls == []
    await idle(engines[1])


def test_a_handle_without_p_s_first_token_is_refused(engines) -> None:
    seam = make_seam(engines)
    with pytest.raises(ValidationError, match="comes with P's first token"):
        DecodeRequest(request_id="d1", endpoint="completions", body={}, prompt_token_ids=PROMPT,
                      output_token_ids=[], kv=handle(seam))  # fmt: skip
