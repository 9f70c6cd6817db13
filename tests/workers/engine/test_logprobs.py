"""workers.engine.logprobs and the engine's new_logprobs: the log-softmax of the raw logits for
the sampled token and the k most likely, one entry per generated token, in every shape."""

from __future__ import annotations

import numpy as np

from tests.workers.engine.numpy_runner import next_token
from tests.workers.engine.test_engine import make_engine, prompt
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.logprobs import sampled_logprobs

VOCAB = 128


def _reference(sequence: list[int]) -> np.ndarray:
    """The numpy runner's logits row for a sequence, log-softmaxed in float64."""
    target = next_token(sequence, VOCAB)
    row = (-0.5 * np.abs(np.arange(VOCAB) - target)).astype(np.float32).astype(np.float64)
    return row - np.log(np.sum(np.exp(row - row.max()))) - row.max()


def test_sampled_logprobs_is_the_raw_log_softmax_with_sorted_top() -> None:
    row = np.array([1.0, 3.0, 3.0, -2.0, 0.5], dtype=np.float32)
    got = sampled_logprobs(row, 4, 3)
    expected = row.astype(np.float64) - np.log(np.sum(np.exp(row.astype(np.float64))))
    assert got.token_id == 4
    assert got.logprob == float(expected[4])
    # most likely first; the tie between ids 1 and 2 goes to the lower id
    assert [t for t, _ in got.top] == [1, 2, 0]
    assert [lp for _, lp in got.top] == [float(expected[i]) for i in (1, 2, 0)]
    assert sampled_logprobs(row, 0, 0).top == ()


def test_engine_reports_logprobs_of_each_token_without_changing_the_tokens() -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    plain = make_engine().generate([EngineRequest("a", prompt(9), params)])["a"]
    with_lp = SamplingParams(max_tokens=6, temperature=0.8, seed=11, num_logprobs=4)
    outputs = make_engine().generate([EngineRequest("a", prompt(9), with_lp)])["a"]
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in plain]
    assert all(o.new_logprobs == () for o in plain)
    sequence = list(prompt(9))
    for out in outputs:
        (entry,) = out.new_logprobs
        (token,) = out.new_token_ids
        reference = _reference(sequence)
        assert entry.token_id == token
        assert abs(entry.logprob - reference[token]) < 1e-9
        assert len(entry.top) == 4
        assert entry.top[0][0] == int(np.argmax(reference))
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        sequence.append(token)


def test_zero_top_logprobs_still_reports_the_sampled_token() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, num_logprobs=0)
    outputs = make_engine().generate([EngineRequest("z", prompt(5), params)])["z"]
    assert [len(o.new_logprobs) for o in outputs] == [1, 1, 1]
    assert all(o.new_logprobs[0].top == () for o in outputs)


def test_prefill_then_decode_gives_the_mixed_logprobs() -> None:
    """The PD split on one engine each: P's first token and D's continuation report exactly
    the logprobs the mixed run does."""
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=3, num_logprobs=2)
    mixed = make_engine().generate([EngineRequest("m", prompt(10), params)])["m"]
    p_out = make_engine().generate([EngineRequest("p", prompt(10), params, prefill_only=True)])["p"]
    first = p_out[-1].new_token_ids[0]
    d_out = make_engine().generate(
        [EngineRequest("d", prompt(10), params, output_token_ids=(first,))]
    )["d"]
    split = [lp for o in p_out + d_out for lp in o.new_logprobs]
    assert split == [lp for o in mixed for lp in o.new_logprobs]
