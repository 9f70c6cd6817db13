"""Progress events of a chunked prefill_only request: the blocks each chunk completed, pinned
until release(), through a preemption and an abort (no Paddle)."""

from __future__ import annotations

from tests.workers.engine.test_scheduler import chunk_view, make, req, step
from workers.engine.request_state import RequestStatus


def progress(outputs: list) -> list[tuple[int, tuple[int, ...]]]:
    return [(o.ready_from_block, o.ready_block_ids) for o in outputs if o.ready_block_ids]


def test_each_chunk_reports_the_blocks_it_completed_and_pins_them() -> None:
    s = make(num_blocks=8, block_size=4, budget=4)
    s.add(req("p", 10, prefill_only=True, report_progress=True))
    _, outputs = step(s)
    assert progress(outputs) == [(0, (0,))]
    (event,) = outputs
    assert (event.new_token_ids, event.finished, event.block_ids) == ((), False, ())
    assert s.pool.ref_count(0) == 2  # the request's table and the pin
    _, outputs = step(s)
    assert progress(outputs) == [(1, (1,))]
    _, outputs = step(s, token=ord("q"))  # the last 2 tokens: the partial block, no event
    (final,) = outputs
    assert progress(outputs) == []
    assert (final.finish_reason, final.block_ids) == ("prefill_done", (0, 1, 2))
    assert s.pins == {"p": [0, 1]}
    assert [s.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    assert s.release("p") is True
    assert s.pool.num_used == 0 and s.pins == {}
    s.pool.check_integrity()


def test_a_chunk_that_completes_no_block_reports_nothing() -> None:
    s = make(num_blocks=8, block_size=4, budget=3)
    s.add(req("p", 9, prefill_only=True, report_progress=True))
    assert progress(step(s)[1]) == []  # tokens [0, 3): block 0 not yet full
    assert progress(step(s)[1]) == [(0, (0,))]  # [3, 6)
    _, outputs = step(s)  # [6, 9): the final chunk samples; its blocks are in its output
    assert progress(outputs) == [] and outputs[0].block_ids == (0, 1, 2)
    assert s.requests["p"].status is RequestStatus.HELD and s.pins == {"p": [0]}


def test_without_report_progress_no_event_and_no_pin() -> None:
    s = make(num_blocks=8, block_size=4, budget=4)
    s.add(req("p", 10, prefill_only=True))
    assert step(s)[1] == [] and step(s)[1] == []
    assert s.pins == {} and s.pool.ref_count(0) == 1


def test_progress_is_only_for_prefill_only_requests() -> None:
    s = make(num_blocks=8, block_size=4, budget=4)
    s.add(req("r", 10, report_progress=True))
    assert step(s)[1] == [] and s.pins == {}


def test_pinned_blocks_survive_a_preemption_and_the_resume_goes_on_after_them() -> None:
    s = make(num_blocks=4, block_size=2, budget=4)
    s.add(req("a", 2, max_tokens=2))
    s.add(req("p", 6, prefill_only=True, report_progress=True))
    batch, outputs = step(s)  # a: its prompt in block 0; p: tokens [0, 2) in block 1
    assert chunk_view(batch) == [("a", 2, 0, (0,), True), ("p", 2, 0, (1,), False)]
    assert progress(outputs) == [(0, (1,))]
    # a grows into block 2; p needs two more blocks, one is free: p preempts itself.
    batch, outputs = step(s)
    assert chunk_view(batch) == [("a", 1, 2, (0, 2), True)]
    p = s.requests["p"]
    assert (p.status, p.block_ids, p.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert s.pool.ref_count(1) == 1 and 1 not in s.pool.free_ids()  # only the pin holds it
    assert outputs[0].finish_reason == "length"  # a is done: blocks 0 and 2 come back
    # p resumes by recompute in other blocks; the next event starts at block 1 of its prompt.
    batch, outputs = step(s)
    assert chunk_view(batch) == [("p", 4, 0, (3, 0), False)]
    assert progress(outputs) == [(1, (0,))]
    _, outputs = step(s, token=ord("q"))
    assert outputs[-1].block_ids == (3, 0, 2)
    assert s.pins == {"p": [1, 0]}
    assert s.release("p") is True
    assert s.pool.num_used == 0
    s.pool.check_integrity()


def test_abort_keeps_the_pins_until_release() -> None:
    s = make(num_blocks=8, block_size=4, budget=4)
    s.add(req("p", 10, prefill_only=True, report_progress=True))
    step(s)
    assert s.abort("p") is not None
    assert s.pins == {"p": [0]} and s.pool.ref_count(0) == 1 and s.pool.num_used == 1
    assert s.release("p") is True
    assert s.pool.num_used == 0 and s.release("p") is False
    s.pool.check_integrity()
