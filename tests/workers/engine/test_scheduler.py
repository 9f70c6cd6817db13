"""Scheduler: exact chunks, block ids, preemption order and resume (no Paddle)."""

from __future__ import annotations

import time

import pytest

from tests.workers.engine.char_tokenizer import CharDetokenizer
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.block_pool import BlockPool
from workers.engine.request_state import RequestStatus
from workers.engine.request_validation import RequestLimits
from workers.engine.scheduler import Scheduler

A = ord("a")


def make(
    num_blocks: int = 8,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 64,
    eos: tuple[int, ...] = (0,),
) -> Scheduler:
    limits = RequestLimits(block_size, num_blocks, max_model_len, vocab_size=128)
    return Scheduler(
        BlockPool(num_blocks),
        limits,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        eos_token_ids=eos,
        new_detokenizer=CharDetokenizer,
        new_seed=lambda: 4242,
    )


def req(rid: str, num_prompt: int, max_tokens: int = 16, **kwargs) -> EngineRequest:
    params = kwargs.pop("params", SamplingParams(max_tokens=max_tokens, temperature=0.0))
    prompt = tuple(A + (i % 26) for i in range(num_prompt))
    return EngineRequest(rid, prompt, params, **kwargs)


def chunk_view(batch: ScheduledBatch) -> list[tuple]:
    return [
        (c.request_id, len(c.token_ids), c.start_pos, c.block_ids, c.need_logits)
        for c in batch.chunks
    ]


def step(s: Scheduler, token: int = A) -> tuple[ScheduledBatch, list]:
    batch = s.schedule()
    num_rows = sum(c.need_logits for c in batch.chunks)
    outputs = s.update(batch, [token] * num_rows)
    s.pool.check_integrity()
    return batch, outputs


def test_prefill_then_decode_with_exact_blocks() -> None:
    s = make()
    s.add(req("r", 6))
    batch = s.schedule()
    assert batch.chunks == (ScheduledChunk("r", tuple(range(A, A + 6)), 0, (0, 1), True),)
    outputs = s.update(batch, [ord("x")])
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.new_token_ids, out.new_text, out.finished) == ((ord("x"),), "x", False)
    assert (out.num_prompt_tokens, out.num_output_tokens) == (6, 1)
    assert chunk_view(s.schedule()) == [("r", 1, 6, (0, 1), True)]


def test_decode_grows_the_block_table_at_a_boundary() -> None:
    s = make()
    s.add(req("r", 7))
    step(s)  # prefill 7 tokens, sample token at position 7
    batch, _ = step(s)  # computes position 7: still block 1
    assert chunk_view(batch) == [("r", 1, 7, (0, 1), True)]
    batch, _ = step(s)  # computes position 8: needs block 2
    assert chunk_view(batch) == [("r", 1, 8, (0, 1, 2), True)]
    assert s.pool.num_used == 3


def test_long_prompt_is_prefilled_in_chunks() -> None:
    s = make(budget=4)
    s.add(req("r", 10))
    views = [chunk_view(step(s)[0]) for _ in range(3)]
    assert views == [
        [("r", 4, 0, (0,), False)],
        [("r", 4, 4, (0, 1), False)],
        [("r", 2, 8, (0, 1, 2), True)],
    ]
    assert s.requests["r"].num_computed_tokens == 10
    assert s.requests["r"].output_token_ids == [A]


def test_decodes_come_first_then_prefill_chunks_fill_the_budget() -> None:
    s = make(budget=5)
    s.add(req("a", 2))
    s.add(req("b", 3))
    step(s)  # both prefilled in one step: 2 + 3 tokens
    s.add(req("c", 9))
    batch, _ = step(s)
    assert chunk_view(batch) == [
        ("a", 1, 2, (0,), True),
        ("b", 1, 3, (1,), True),
        ("c", 3, 0, (2,), False),
    ]
    batch, _ = step(s)
    assert chunk_view(batch) == [
        ("a", 1, 3, (0,), True),
        ("b", 1, 4, (1, 3), True),
        ("c", 3, 3, (2, 4), False),
    ]


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add(req(rid, 2))
    batch, _ = step(s)
    assert [c.request_id for c in batch.chunks] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preempts_the_most_recent_and_resumes_by_recompute() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(req("a", 3, max_tokens=3))
    s.add(req("b", 3, max_tokens=6))
    assert chunk_view(step(s)[0]) == [("a", 3, 0, (0, 1), True), ("b", 3, 0, (2, 3), True)]
    assert chunk_view(step(s)[0]) == [("a", 1, 3, (0, 1), True), ("b", 1, 3, (2, 3), True)]
    # Both now need position 4 (a third block) and the pool is full: "a" preempts "b".
    batch, outputs = step(s)
    assert chunk_view(batch) == [("a", 1, 4, (0, 1, 2), True)]
    b = s.requests["b"]
    assert (b.status, b.block_ids, b.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert b.output_token_ids == [A, A]
    assert s.num_preemptions_total == 1
    # "a" finished (max_tokens=3) and freed [0, 1, 2]; "b" resumes: all 5 tokens recomputed.
    assert outputs[0].finish_reason == "length"
    assert s.pool.free_ids() == [3, 0, 1, 2]
    batch, outputs = step(s, token=ord("z"))
    assert chunk_view(batch) == [("b", 5, 0, (3, 0, 1), True)]
    assert batch.chunks[0].token_ids == (A, A + 1, A + 2, A, A)
    assert (outputs[0].new_token_ids, outputs[0].num_output_tokens) == ((ord("z"),), 3)


def test_a_request_that_cannot_grow_preempts_itself_and_waits() -> None:
    s = make(num_blocks=3, block_size=2)
    s.add(req("p", 4, prefill_only=True))
    step(s)  # holds blocks [0, 1] until release
    s.add(req("r", 2, max_tokens=4))
    assert chunk_view(step(s)[0]) == [("r", 2, 0, (2,), True)]
    batch, outputs = step(s)  # needs a block for position 2: only itself to preempt
    assert batch.is_empty and outputs == []
    assert s.requests["r"].status is RequestStatus.WAITING
    assert s.schedule().is_empty  # nothing changes until an outside event
    assert s.release("p")
    assert chunk_view(step(s)[0]) == [("r", 3, 0, (2, 0), True)]


def test_prefill_only_keeps_blocks_until_release() -> None:
    s = make()
    s.add(req("p", 5, prefill_only=True))
    _, outputs = step(s, token=ord("q"))
    (out,) = outputs
    assert (out.finished, out.finish_reason, out.block_ids) == (True, "prefill_done", (0, 1))
    assert (out.new_token_ids, out.new_text, out.num_output_tokens) == ((ord("q"),), "q", 1)
    assert s.pool.num_used == 2 and "p" in s.held and not s.has_unfinished()
    assert s.release("p") is True
    assert s.release("p") is False
    assert s.pool.num_used == 0 and "p" not in s.requests


def test_prefill_only_reports_a_real_stop_and_still_holds_blocks() -> None:
    s = make()
    s.add(req("p", 3, prefill_only=True))
    _, outputs = step(s, token=0)  # eos
    assert (outputs[0].finish_reason, outputs[0].block_ids) == ("stop", (0,))
    assert s.abort("p").finish_reason == "abort"
    assert s.pool.num_used == 0


def test_decode_role_request_continues_from_preallocated_blocks() -> None:
    s = make()
    block_ids = s.pool.allocate(2)
    assert block_ids == [0, 1]
    s.add(
        req(
            "d",
            7,
            max_tokens=4,
            output_token_ids=(ord("t"),),
            preallocated_block_ids=(0, 1),
            num_computed_tokens=5,
        )
    )
    batch = s.schedule()
    assert chunk_view(batch) == [("d", 3, 5, (0, 1), True)]
    assert batch.chunks[0].token_ids == (A + 5, A + 6, ord("t"))
    assert s.sample_specs(batch)[0].position == 8
    outputs = s.update(batch, [ord("u")])
    # The given first token is not re-emitted; it counts towards max_tokens.
    assert (outputs[0].new_token_ids, outputs[0].new_text) == ((ord("u"),), "u")
    assert outputs[0].num_output_tokens == 2
    batch, _ = step(s)
    assert chunk_view(batch) == [("d", 1, 8, (0, 1, 2), True)]
    _, outputs = step(s)
    assert outputs[0].finish_reason == "length" and outputs[0].num_output_tokens == 4
    assert s.pool.num_used == 0


def test_waiting_holder_may_pass_a_head_that_does_not_fit() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(req("p", 4, prefill_only=True))
    step(s)  # p holds [0, 1]
    held = s.pool.allocate(1)
    s.add(req("big", 5, max_tokens=2))  # needs 3 blocks, 1 free
    s.add(req("small", 1, max_tokens=2))  # needs 1 block but holds none: waits behind "big"
    s.add(
        req(
            "d",
            2,
            max_tokens=3,
            output_token_ids=(A,),
            preallocated_block_ids=tuple(held),
            num_computed_tokens=2,
        )
    )
    batch, _ = step(s)
    assert chunk_view(batch) == [("d", 1, 2, (2, 3), True)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_waiting_holders_give_up_blocks_when_nothing_can_run() -> None:
    s = make(num_blocks=4, block_size=2)
    first, second = s.pool.allocate(2), s.pool.allocate(2)
    for rid, block_ids in (("d1", first), ("d2", second)):
        s.add(
            req(
                rid,
                4,
                max_tokens=3,
                output_token_ids=(A,),
                preallocated_block_ids=tuple(block_ids),
                num_computed_tokens=4,
            )
        )
    # Each needs a third block to compute position 4; none is free.
    batch, _ = step(s)
    assert chunk_view(batch) == [("d1", 1, 4, (0, 1, 2), True)]
    d2 = s.requests["d2"]
    assert (d2.block_ids, d2.num_computed_tokens, d2.num_preemptions) == ([], 0, 1)
    assert s.pool.free_ids() == [3]


def test_abort_frees_blocks_in_any_state() -> None:
    s = make(num_blocks=2, block_size=4)
    s.add(req("run", 4, max_tokens=4))
    s.add(req("wait", 4, max_tokens=4))
    step(s)
    out = s.abort("run")
    assert (out.finished, out.finish_reason, out.new_token_ids, out.num_output_tokens) == (
        True,
        "abort",
        (),
        1,
    )
    assert s.pool.free_ids() == [0]
    assert s.abort("wait").finish_reason == "abort"
    assert s.abort("wait") is None
    assert s.requests == {} and s.pool.num_used == 0


def test_eos_finishes_unless_ignored_and_stop_token_ids_stop() -> None:
    s = make()
    s.add(req("e", 2))
    s.add(req("i", 2, params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    s.add(req("t", 2, params=SamplingParams(max_tokens=5, stop_token_ids=(ord("!"),))))
    batch = s.schedule()
    outputs = s.update(batch, [0, 0, ord("!")])
    assert [(o.request_id, o.finish_reason, o.new_text) for o in outputs] == [
        ("e", "stop", ""),
        ("i", None, "\x00"),
        ("t", "stop", ""),
    ]
    assert list(s.requests) == ["i"]


def test_sequence_reaching_max_model_len_finishes_with_length() -> None:
    s = make(max_model_len=6)
    s.add(req("r", 4, max_tokens=10))
    step(s)
    _, outputs = step(s)
    assert (outputs[0].finish_reason, outputs[0].num_output_tokens) == ("length", 2)


def test_sample_specs_carry_seed_and_absolute_position() -> None:
    s = make()
    s.add(req("seeded", 3, params=SamplingParams(seed=9, temperature=0.5, top_k=3)))
    s.add(req("unseeded", 5, params=SamplingParams(top_p=0.8)))
    specs = s.sample_specs(s.schedule())
    assert [(x.seed, x.position, x.temperature, x.top_k, x.top_p) for x in specs] == [
        (9, 3, 0.5, 3, 1.0),
        (4242, 5, 1.0, 0, 0.8),
    ]


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(num_prompt=0), "prompt is empty"),
        (dict(num_prompt=64), "leaves no room to generate within max_model_len=64"),
        (dict(num_prompt=3, max_tokens=0), "max_tokens must be >= 1"),
        (dict(num_prompt=40, max_tokens=20), "need up to 15 KV blocks of 4 tokens"),
        (dict(num_prompt=3, max_tokens=1, output_token_ids=(A,)), "already reach max_tokens=1"),
        (dict(num_prompt=3, num_computed_tokens=3), "num_computed_tokens=3 must be in"),
        (
            dict(num_prompt=9, num_computed_tokens=8, preallocated_block_ids=(0,)),
            "expected between 2 and 3",
        ),
        (dict(num_prompt=3, preallocated_block_ids=(99,)), "outside"),
        (dict(num_prompt=3, params=SamplingParams(top_p=0.0)), "top_p must be in"),
        (dict(num_prompt=3, params=SamplingParams(temperature=-1.0)), "temperature"),
        (dict(num_prompt=3, params=SamplingParams(stop=("",))), "stop strings"),
        (dict(num_prompt=3, params=SamplingParams(top_k=-1)), "top_k"),
    ],
)
def test_invalid_requests_are_rejected_at_add(request_kwargs: dict, message: str) -> None:
    s = make(num_blocks=14)
    num_prompt = request_kwargs.pop("num_prompt")
    with pytest.raises(ValueError, match=message):
        s.add(req("bad", num_prompt, **request_kwargs))
    assert s.requests == {} and s.pool.num_used == 0


def test_out_of_vocab_token_and_duplicate_id_are_rejected() -> None:
    s = make()
    with pytest.raises(ValueError, match="token id 500 outside the vocabulary"):
        s.add(EngineRequest("x", (1, 500), SamplingParams()))
    s.add(req("x", 2))
    with pytest.raises(ValueError, match="already in the engine"):
        s.add(req("x", 2))


def test_preallocated_block_must_be_allocated() -> None:
    s = make()
    with pytest.raises(ValueError, match="preallocated block 0 is free"):
        s.add(req("d", 3, preallocated_block_ids=(0,), num_computed_tokens=2))


def test_preempting_an_already_scheduled_victim_drops_its_chunk() -> None:
    # The admission policy never admits a request behind one still prefilling, so this state
    # is set up by hand: "a" (admitted first) has 6 uncomputed tokens, "b" is decoding.
    s = make(num_blocks=4, block_size=2)
    s.add(req("a", 3, max_tokens=5))
    s.add(req("b", 1, max_tokens=5))
    step(s)
    a = s.requests["a"]
    a.output_token_ids.extend([A, A, A])  # 7 tokens, 3 computed
    batch = s.schedule()
    # "b" was scheduled first (decodes go first), then preempted for "a"'s growth.
    assert chunk_view(batch) == [("a", 4, 3, (0, 1, 3, 2), True)]
    assert s.requests["b"].status is RequestStatus.WAITING
    assert s.num_preemptions_total == 1
    s.pool.check_integrity()


def test_a_request_knows_when_it_was_first_scheduled() -> None:
    """Its queue ends at its first scheduling (P's queue span); a resume keeps that time."""
    s = make(max_num_seqs=1)
    s.add(req("a", 2, max_tokens=2))
    s.add(req("b", 2, max_tokens=2))
    before_s = time.monotonic()
    _, outputs = step(s)
    a_s = s.requests["a"].scheduled_s
    assert before_s <= a_s <= time.monotonic() and outputs[0].scheduled_s == a_s
    assert s.requests["b"].scheduled_s == 0.0  # still waiting: its queue goes on
    step(s)  # "a" finishes
    _, outputs = step(s)
    assert outputs[0].request_id == "b" and outputs[0].scheduled_s > a_s


def test_a_resume_after_a_preemption_keeps_its_first_scheduling() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(req("a", 3, max_tokens=3))
    s.add(req("b", 3, max_tokens=6))
    step(s)
    b_s = s.requests["b"].scheduled_s
    step(s)
    step(s)  # "a" preempts "b"
    assert s.requests["b"].status is RequestStatus.WAITING
    _, outputs = step(s)  # "b" resumes
    assert outputs[0].request_id == "b" and outputs[0].scheduled_s == b_s > 0.0
