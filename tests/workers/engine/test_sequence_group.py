"""Sequence groups (workers/engine/sequence_group.py): one request of n sequences, its prompt
computed once, forked with shared full blocks and a copied partial block, over the numpy
stand-in runner (exact blocks and tokens), then on the tiny Paddle model (the KV copy)."""

from __future__ import annotations

import numpy as np
import pytest

from pdrouter.wire.choices import choice_seed
from tests.workers.engine.numpy_runner import reference_greedy
from tests.workers.engine.test_engine import GREEDY, make_engine, prompt
from tests.workers.engine.tiny_engine import encoded, real_engine, tokens_of
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.request_state import RequestStatus


def by_sequence(outputs: list, n: int) -> list[list]:
    return [[o for o in outputs if o.sequence_index == j] for j in range(n)]


def group(rid: str, tokens: tuple[int, ...], params: SamplingParams, n: int) -> EngineRequest:
    seeds = tuple(choice_seed(params.seed, j) for j in range(n))
    return EngineRequest(rid, tokens, params, sequence_seeds=seeds)


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    engine = make_engine(num_blocks=16, block_size=4, prefix_cache=False)
    engine.add_request(group("g", prompt(10), SamplingParams(max_tokens=3, temperature=0.0), 3))
    first = engine.step()  # the prompt, computed once; every sequence's first token
    assert engine.last_step_num_tokens == 10
    assert [(o.request_id, o.sequence_index, o.finished) for o in first] == [
        ("g", 1, False), ("g", 2, False), ("g", 0, False),
    ]  # fmt: skip
    s = engine.scheduler
    tables = [s.requests[key].block_ids for key in ("g", "g#1", "g#2")]
    assert tables == [[0, 1, 2], [0, 1, 4], [0, 1, 3]]
    # The full blocks shared by 3 tables; the partial one held by its owner and, until
    # their copies are made, by each child.
    assert [engine.pool.ref_count(b) for b in range(5)] == [3, 3, 3, 1, 1]
    assert engine.pool.num_used == 5
    second = engine.step()  # one decode batch of all three: copies first
    assert engine.last_step_num_chunks == 3 and len(second) == 3
    assert [engine.pool.ref_count(b) for b in range(5)] == [3, 3, 1, 1, 1]
    cache = engine.runner.cache
    assert cache[2][:2].tolist() == cache[3][:2].tolist() == cache[4][:2].tolist()
    assert {s.requests[k].copy_from for k in ("g#1", "g#2")} == {None}
    rest = engine.generate([])["g"] if engine.has_unfinished() else []
    outputs = first + second + rest
    assert outputs[-1].ends_stream and not any(o.ends_stream for o in outputs[:-1])
    assert engine.pool.num_used == 0 and engine.pool.num_free == 16
    assert s.group_keys == {} and s.requests == {}
    engine.pool.check_integrity()


def test_greedy_sequences_equal_each_other_and_the_reference() -> None:
    engine = make_engine(prefix_cache=True)
    outputs = engine.generate([group("g", prompt(9), GREEDY, 2)])["g"]
    seqs = [tokens_of(seq) for seq in by_sequence(outputs, 2)]
    assert seqs == [reference_greedy(list(prompt(9)), 12)] * 2
    assert engine.stats().num_prompt_tokens_total == 9
    assert engine.pool.num_used == 0


def test_seeded_group_equals_separate_requests_with_derived_seeds() -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = make_engine().generate([
        EngineRequest(f"s{j}", prompt(7), SamplingParams(
            max_tokens=10, temperature=1.0, top_p=0.9, seed=choice_seed(1234, j)))
        for j in range(3)
    ])  # fmt: skip
    engine = make_engine()
    outputs = engine.generate([group("g", prompt(7), params, 3)])["g"]
    seqs = by_sequence(outputs, 3)
    assert [tokens_of(seq) for seq in seqs] == [tokens_of(alone[f"s{j}"]) for j in range(3)]
    assert len({tuple(tokens_of(seq)) for seq in seqs}) == 3  # each its own draws
    # The prompt was computed once: 7 prompt tokens, then one token per sequence per step.
    assert engine.num_steps_total == 10
    assert engine.pool.num_used == 0


def test_preempted_sequences_resume_by_recompute_with_the_same_tokens() -> None:
    engine = make_engine(num_blocks=9, block_size=4, budget=8, prefix_cache=False)
    outputs = engine.generate([group("g", prompt(6), GREEDY, 3)])["g"]
    assert engine.stats().num_preemptions_total > 0
    reference = reference_greedy(list(prompt(6)), 12)
    assert [tokens_of(seq) for seq in by_sequence(outputs, 3)] == [reference] * 3
    assert engine.pool.num_used == 0
    engine.pool.check_integrity()


def test_abort_frees_every_sequence() -> None:
    engine = make_engine(num_blocks=16, prefix_cache=False)
    engine.add_request(group("g", prompt(10), GREEDY, 3))
    engine.add_request(EngineRequest("other", prompt(5, 1), GREEDY))
    engine.step()
    engine.step()
    assert engine.pool.num_used == 3 + 2 + 2  # g's 3 prompt blocks, 2 copies; other's 2
    out = engine.abort("g")
    assert (out.request_id, out.finish_reason, out.ends_stream) == ("g", "abort", True)
    assert engine.pool.num_used == 2
    assert engine.abort("g") is None
    engine.generate([])
    assert engine.pool.num_used == 0


def test_abort_before_the_fork_frees_the_reserved_blocks() -> None:
    engine = make_engine(num_blocks=16, budget=8, prefix_cache=False)
    engine.add_request(group("g", prompt(10), GREEDY, 3))
    engine.step()  # 8 of 10 prompt tokens: not forked yet
    assert engine.pool.num_used == 2
    engine.step()  # the rest: forked
    engine.abort("g")
    assert engine.pool.num_used == 0


def test_a_sequence_that_ends_on_its_first_token_never_runs() -> None:
    engine = make_engine(prefix_cache=False)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    outputs = engine.generate([group("g", prompt(6), params, 2)])["g"]
    assert [(o.sequence_index, o.finish_reason, o.more_sequences) for o in outputs] == [
        (1, "length", True), (0, "length", False),
    ]  # fmt: skip
    assert engine.pool.num_used == 0


def test_prefill_only_group_samples_every_first_token_and_holds_one_prompt() -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    engine = make_engine(prefix_cache=False)
    engine.add_request(
        EngineRequest("p", prompt(9), params, prefill_only=True,
                      sequence_seeds=tuple(choice_seed(5, j) for j in range(3)))
    )  # fmt: skip
    outputs = engine.step()
    assert [(o.sequence_index, o.finish_reason, o.block_ids) for o in outputs] == [
        (1, "prefill_done", ()), (2, "prefill_done", ()), (0, "prefill_done", (0, 1, 2)),
    ]  # fmt: skip
    assert [o.ends_stream for o in outputs] == [False, False, True]
    mixed = make_engine().generate([group("g", prompt(9), params, 3)])["g"]
    firsts = {o.sequence_index: o.new_token_ids for o in mixed if o.num_output_tokens == 1}
    assert {o.sequence_index: o.new_token_ids for o in outputs} == firsts
    assert engine.pool.num_used == 3
    assert engine.release("p") and engine.pool.num_used == 0


def _paddle_tokens(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list]:
    return engine.generate(requests)


def test_group_on_the_tiny_model_equals_separate_requests(loaded) -> None:
    text = encoded(loaded, "the quick brown fox jumps")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=9)
    separate = _paddle_tokens(real_engine(loaded, prefix_cache=False), [
        EngineRequest(f"s{j}", text, SamplingParams(max_tokens=6, temperature=0.8,
                                                    seed=choice_seed(9, j)))
        for j in range(3)
    ])  # fmt: skip
    engine = real_engine(loaded, prefix_cache=False)
    assert len(text) % 4 != 0  # a partial last block to copy
    outputs = _paddle_tokens(engine, [group("g", text, params, 3)])["g"]
    got = [tokens_of(seq) for seq in by_sequence(outputs, 3)]
    assert got == [tokens_of(separate[f"s{j}"]) for j in range(3)]
    assert engine.pool.num_used == 0
    np.testing.assert_equal(len(got), 3)


@pytest.mark.parametrize("num_computed", [9, 8, 4, 0])
def test_prefill_group_then_decode_group_equals_mixed(num_computed: int) -> None:
    """P samples every first token of a prompt it computed once; D loads the prompt once,
    forks at its end and decodes the sequences in one batch: the mixed group's tokens."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=21)
    seeds = tuple(choice_seed(21, j) for j in range(3))
    mixed = make_engine().generate([group("m", prompt(9), params, 3)])["m"]
    prefill = make_engine(prefix_cache=False)
    prefill.add_request(EngineRequest("p", prompt(9), params, prefill_only=True,
                                      sequence_seeds=seeds))  # fmt: skip
    firsts = {o.sequence_index: o for o in prefill.step()}
    decode = make_engine(prefix_cache=False)
    block_ids = decode.allocate_blocks(-(-num_computed // 4))
    decode.runner.write(block_ids, prefill.runner.read(firsts[0].block_ids, num_computed))
    decode.add_request(
        EngineRequest(
            "d", prompt(9), params,
            output_token_ids=firsts[0].new_token_ids,
            preallocated_block_ids=tuple(block_ids),
            num_computed_tokens=num_computed,
            sequence_seeds=seeds,
            sequence_output_token_ids=(firsts[1].new_token_ids, firsts[2].new_token_ids),
        )
    )  # fmt: skip
    rest = decode.generate([])["d"] if decode.has_unfinished() else []
    # the prompt's tail, once, on sequence 0; then each sequence's first token at once
    assert decode.stats().num_preemptions_total == 0
    got = [tokens_of([firsts[j], *seq]) for j, seq in enumerate(by_sequence(rest, 3))]
    assert got == [tokens_of(seq) for seq in by_sequence(mixed, 3)]
    assert rest[-1].ends_stream and decode.pool.num_used == 0
    decode.pool.check_integrity()


def test_decode_group_refuses_missing_outputs() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="2 output token lists for 3"):
        engine.add_request(
            EngineRequest("d", prompt(9), GREEDY, output_token_ids=(40,),
                          sequence_seeds=(1, 2, 3, 4), sequence_output_token_ids=((1,), (2,)))
        )  # fmt: skip
    with pytest.raises(ValueError, match="sequence 0 has tokens"):
        engine.add_request(
            EngineRequest("d", prompt(9), GREEDY, output_token_ids=(40,), sequence_seeds=(1, 2))
        )


def test_a_group_whose_fork_cannot_fit_is_refused() -> None:
    engine = make_engine(num_blocks=4, block_size=4)
    too_big = group("g", prompt(14), SamplingParams(max_tokens=1), 2)
    for check in (engine.validate, engine.add_request):
        with pytest.raises(ValueError, match="4 KV blocks and a last block for each of 2"):
            check(too_big)
    engine.add_request(group("ok", prompt(12), SamplingParams(max_tokens=1), 2))


def test_prefill_only_groups_take_one_seat_each() -> None:
    """On P a group's later sequences never run (their first tokens are sampled from the
    prompt's logits): two groups of 3 share a batch of 4 seats."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    engine = make_engine(prefix_cache=False, max_num_seqs=4)
    for rid in ("p1", "p2"):
        engine.add_request(
            EngineRequest(rid, prompt(9), params, prefill_only=True,
                          sequence_seeds=tuple(choice_seed(5, j) for j in range(3)))
        )  # fmt: skip
    outputs = engine.step()
    assert sorted((o.request_id, o.sequence_index) for o in outputs if o.finished) == [
        ("p1", 0), ("p1", 1), ("p1", 2), ("p2", 0), ("p2", 1), ("p2", 2)
    ]  # fmt: skip


def test_forked_sequences_carry_their_groups_scheduling_time() -> None:
    engine = make_engine(num_blocks=16, block_size=4, prefix_cache=False)
    engine.add_request(group("g", prompt(10), SamplingParams(max_tokens=3, temperature=0.0), 3))
    first = engine.step()
    stamps = {o.sequence_index: o.scheduled_s for o in first}
    assert stamps[0] > 0 and stamps == {0: stamps[0], 1: stamps[0], 2: stamps[0]}
    children = [engine.scheduler.requests[key] for key in ("g#1", "g#2")]
    assert [c.status for c in children] == [RequestStatus.RUNNING] * 2
    assert {o.scheduled_s for o in engine.step()} == {stamps[0]}
