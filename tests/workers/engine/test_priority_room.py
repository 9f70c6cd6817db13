"""Less urgent running requests give way to a more urgent waiting one (no Paddle): preempted
for a seat or for blocks, sitting a step out for the token budget, and their streams intact."""

from __future__ import annotations

from tests.workers.engine import caching_scheduler as caching
from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner
from tests.workers.engine.test_scheduler import A, chunk_view, make, req, step
from tests.workers.engine.tiny_engine import tokens_of
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.request_state import RequestStatus


def preq(rid: str, num_prompt: int, priority: int, max_tokens: int = 16):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority)
    return req(rid, num_prompt, params=params)


def ids(states) -> list[str]:
    return [s.request_id for s in states]


def test_a_more_urgent_request_takes_the_seat_of_the_newest_least_urgent() -> None:
    s = make(max_num_seqs=3, num_blocks=16)
    for rid, priority in (("mid", 0), ("low1", 5), ("low2", 5)):
        s.add(preq(rid, 3, priority))
    step(s)  # all three run: blocks [0], [1], [2]
    s.add(preq("high", 2, priority=-1))
    batch, _ = step(s)
    # low2 (least urgent, newest) is preempted in the step that admits high
    assert chunk_view(batch) == [
        ("mid", 1, 3, (0,), True),
        ("low1", 1, 3, (1,), True),
        ("high", 2, 0, (3,), True),
    ]
    low2 = s.requests["low2"]
    assert (low2.status, low2.block_ids, low2.num_preemptions) == (RequestStatus.WAITING, [], 1)
    assert low2.output_token_ids == [A]  # its sampled token is kept for its resume
    assert ids(s.running) == ["mid", "low1", "high"] and ids(s.waiting) == ["low2"]
    # a second urgent request takes low1's seat next; mid (more urgent than low) keeps its own
    s.add(preq("high2", 2, priority=-1))
    batch, _ = step(s)
    assert [c.request_id for c in batch.chunks] == ["mid", "high", "high2"]
    assert ids(s.waiting) == ["low1", "low2"]  # low1 resumed in front of its equal
    assert s.num_preemptions_total == 2


def test_a_more_urgent_request_takes_the_blocks_of_a_less_urgent_one() -> None:
    s = make(num_blocks=4, block_size=2, max_num_seqs=8)
    s.add(preq("low1", 3, priority=3, max_tokens=2))
    s.add(preq("low2", 3, priority=3, max_tokens=2))
    step(s)  # both admitted: low1 [0, 1], low2 [2, 3]; the pool is full
    assert s.pool.num_free == 0
    s.add(preq("high", 3, priority=0, max_tokens=2))
    batch, _ = step(s)
    assert chunk_view(batch) == [("low1", 1, 3, (0, 1), True), ("high", 3, 0, (2, 3), True)]
    assert ids(s.waiting) == ["low2"] and s.requests["low2"].num_preemptions == 1


def test_a_less_urgent_prefill_sits_a_step_out_for_the_token_budget() -> None:
    s = make(budget=4, num_blocks=16)
    s.add(preq("low", 12, priority=5, max_tokens=2))
    assert chunk_view(step(s)[0]) == [("low", 4, 0, (0,), False)]
    s.add(preq("high", 2, priority=0, max_tokens=2))
    # low's next chunk would take the whole budget: it is dropped for high, without a
    # preemption (low keeps its seat, its computed tokens and the block it grew)
    assert chunk_view(step(s)[0]) == [("high", 2, 0, (2,), True)]
    low = s.requests["low"]
    assert (low.status, low.num_computed_tokens, low.block_ids) == (
        RequestStatus.RUNNING, 4, [0, 1],
    )  # fmt: skip
    assert s.num_preemptions_total == 0
    # then high decodes first and the rest of the budget goes to low's prefill
    assert chunk_view(step(s)[0]) == [("high", 1, 2, (2,), True), ("low", 3, 4, (0, 1), False)]


def test_the_more_urgent_of_two_prefills_gets_the_budget_first() -> None:
    s = make(budget=4, num_blocks=16)
    s.add(preq("low", 12, priority=5, max_tokens=2))
    step(s)  # low computes [0, 4)
    s.add(preq("high", 10, priority=0, max_tokens=2))
    assert chunk_view(step(s)[0]) == [("high", 4, 0, (2,), False)]  # low sat it out
    # both prefilling now: high, admitted after low, still takes the budget first
    assert chunk_view(step(s)[0]) == [("high", 4, 4, (2, 3), False)]
    assert chunk_view(step(s)[0]) == [("high", 2, 8, (2, 3, 4), True), ("low", 2, 4, (0, 1), False)]


def test_equals_and_the_more_urgent_are_never_preempted_for_a_waiting_request() -> None:
    s = make(max_num_seqs=1, num_blocks=16)
    s.add(preq("first", 2, priority=0, max_tokens=3))
    step(s)
    s.add(preq("equal", 2, priority=0))
    s.add(preq("later_low", 2, priority=4))
    for _ in range(2):
        assert [c.request_id for c in step(s)[0].chunks] == ["first"]
    assert ids(s.waiting) == ["equal", "later_low"] and s.num_preemptions_total == 0
    # first finished (3 tokens): equal, not the less urgent one, takes the seat
    assert [c.request_id for c in step(s)[0].chunks] == ["equal"]


def make_engine(max_num_seqs: int, num_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=4,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=32,
        max_model_len=32,
        enable_prefix_cache=True,
    )
    return LLMEngine(NumpyRunner(num_blocks, 4), CharTokenizer(), config, vocab_size=128)


def sampled(rid: str, priority: int, seed: int) -> EngineRequest:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, priority=priority)
    return EngineRequest(rid, tuple(97 + (i * 5 + seed) % 26 for i in range(7)), params)


def test_preempted_streams_resume_token_for_token() -> None:
    low = [sampled("low1", 5, seed=11), sampled("low2", 5, seed=12)]
    high = sampled("high", -1, seed=13)
    alone = {r.request_id: tokens_of(make_engine(8).generate([r])[r.request_id])
             for r in [*low, high]}  # fmt: skip
    engine = make_engine(max_num_seqs=2)
    for r in low:
        engine.add_request(r)
    got: dict[str, list[int]] = {r: [] for r in alone}
    finished: list[str] = []

    def run_step() -> None:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append(out.request_id)

    for _ in range(3):
        run_step()
    engine.add_request(high)
    while engine.has_unfinished():
        run_step()
    assert got == alone
    # high passed the two low streams already running; low2 (the newest) gave way
    assert finished == ["low1", "high", "low2"]
    assert engine.stats().num_preemptions_total == 1
    engine.pool.check_integrity()


def test_a_decode_side_allocation_preempts_less_urgent_requests_only_when_it_would_do() -> None:
    low = [sampled("low1", 5, seed=21), sampled("low2", 5, seed=22)]
    mid = sampled("mid", 0, seed=23)
    alone = {r.request_id: tokens_of(make_engine(8).generate([r])[r.request_id])
             for r in [*low, mid]}  # fmt: skip
    engine = make_engine(max_num_seqs=8, num_blocks=8)
    got: dict[str, list[int]] = {r: [] for r in alone}
    for r in [*low, mid]:
        engine.add_request(r)
    for out in engine.step():  # each holds 2 blocks for its 7 + 1 tokens: 2 blocks left free
        got[out.request_id] += out.new_token_ids
    assert engine.pool.num_free == 2
    # 7 blocks: more than the less urgent requests could free; nothing is preempted
    assert engine.allocate_blocks(7, priority=0) is None
    assert engine.allocate_blocks(3) is None  # no priority given: no preemption
    assert engine.stats().num_preemptions_total == 0
    # 5 blocks for a priority 0 request: low2 (least urgent, newest), then low1 give way;
    # mid, as urgent as the request, keeps its blocks
    taken = engine.allocate_blocks(5, priority=0)
    assert taken is not None and len(taken) == 5
    states = engine.scheduler.requests
    assert [states[r].status for r in ("low1", "low2", "mid")] == [
        RequestStatus.WAITING, RequestStatus.WAITING, RequestStatus.RUNNING,
    ]  # fmt: skip
    assert engine.stats().num_preemptions_total == 2
    engine.free_blocks(taken)  # (the decode request went elsewhere): the low ones resume
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got == alone
    engine.pool.check_integrity()


def test_blocks_shared_with_a_request_that_keeps_running_do_not_count_as_freed() -> None:
    s = caching.make(num_blocks=6)
    prompt = caching.tokens(9)
    s.add(EngineRequest("mid", prompt, SamplingParams(max_tokens=8, priority=0)))
    caching.step(s)  # mid [0, 1, 2]; its full blocks 0 and 1 are cached
    s.add(EngineRequest("low", prompt, SamplingParams(max_tokens=8, priority=5)))
    caching.step(s)  # low hits 0 and 1 and computes its last prompt token in 3
    low = s.requests["low"]
    assert (low.block_ids, caching.refs(s, [0, 1, 2, 3]), s.pool.num_free) == (
        [0, 1, 3], [2, 2, 1, 1], 2,
    )  # fmt: skip
    # low holds 3 blocks, but preempting it returns only block 3: 4 blocks cannot be made
    assert s.priority_room.free_for(4, priority=0) is False
    assert (low.status, low.block_ids, s.num_preemptions_total) == (
        RequestStatus.RUNNING, [0, 1, 3], 0,
    )  # fmt: skip
    # 3 blocks can: low gives way, its own block back on the free list
    assert s.priority_room.free_for(3, priority=0) is True
    assert (low.status, s.pool.num_free, caching.refs(s, [0, 1])) == (
        RequestStatus.WAITING, 3, [1, 1],
    )  # fmt: skip
    s.pool.check_integrity()
