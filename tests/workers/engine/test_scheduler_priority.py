"""Scheduler priorities: a more urgent request (lower value) is admitted first, and under KV
pressure the least urgent running request is preempted first (no Paddle)."""

from __future__ import annotations

from collections import deque

from tests.workers.engine.test_scheduler import A, chunk_view, make, req, step
from workers.engine.api import SamplingParams
from workers.engine.priority import enqueue, victim
from workers.engine.request_state import RequestStatus


def preq(rid: str, num_prompt: int, priority: int, max_tokens: int = 16):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority)
    return req(rid, num_prompt, params=params)


def test_the_more_urgent_request_is_admitted_first_and_equals_keep_arrival_order() -> None:
    s = make(max_num_seqs=2)
    for rid, priority in (("low", 5), ("mid1", 0), ("high", -1), ("mid2", 0)):
        s.add(preq(rid, 2, priority))
    assert [r.request_id for r in s.waiting] == ["high", "mid1", "mid2", "low"]
    batch, _ = step(s)
    assert [c.request_id for c in batch.chunks] == ["high", "mid1"]
    assert [r.request_id for r in s.waiting] == ["mid2", "low"]


def test_a_later_urgent_request_passes_a_waiting_less_urgent_one() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(preq("high", 3, priority=-1, max_tokens=3))
    s.add(preq("low", 3, priority=1, max_tokens=6))
    s.add(preq("later", 1, priority=-1, max_tokens=1))
    # Two fit in the pool: "high" and "later" stand in front of "low" in the queue.
    assert [c.request_id for c in step(s)[0].chunks] == ["high", "later"]
    assert [r.request_id for r in s.waiting] == ["low"]


def test_the_victim_is_the_least_urgent_running_request() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(preq("low", 3, priority=2, max_tokens=6))
    step(s)  # "low" runs alone: blocks [0, 1]
    s.add(preq("high", 3, priority=0, max_tokens=6))
    assert chunk_view(step(s)[0]) == [("low", 1, 3, (0, 1), True), ("high", 3, 0, (2, 3), True)]
    # "low" needs a third block; the pool is full. FIFO would preempt "high" (admitted last)
    # and grow "low"; by priority "low" preempts itself, although it was admitted first.
    batch, _ = step(s)
    assert chunk_view(batch) == [("high", 1, 3, (2, 3), True)]
    low = s.requests["low"]
    assert (low.status, low.block_ids, low.num_preemptions) == (RequestStatus.WAITING, [], 1)
    assert low.output_token_ids == [A, A]


def test_a_resumed_request_goes_in_front_of_its_equals_behind_the_more_urgent() -> None:
    s = make()
    for rid, priority in (("h", -1), ("m1", 0), ("m2", 0), ("l", 3)):
        s.add(preq(rid, 2, priority))
    waiting = deque(s.requests[rid] for rid in ("h", "m1", "m2", "l"))
    s.waiting.clear()
    resumed = s.requests["m2"]
    waiting.remove(resumed)
    enqueue(waiting, resumed, resumed=True)
    assert [r.request_id for r in waiting] == ["h", "m2", "m1", "l"]
    running = [s.requests[rid] for rid in ("l", "h", "m1")]
    assert victim(running).request_id == "l"
    assert victim([s.requests["m1"], s.requests["m2"]]).request_id == "m2"
