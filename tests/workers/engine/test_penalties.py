"""Logits adjustments (workers.engine.penalties): the batched sparse version against a dense
per-row reference, min_tokens, and the engine split across P and D equal to one engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner, next_token
from tests.workers.engine.tiny_engine import tokens_of
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.penalties import LogitsAdjust, adjust_logits, check_params, logits_adjust
from workers.engine.sampler import SampleSpec, sample

VOCAB = 128


def dense_reference(row: np.ndarray, a: LogitsAdjust) -> np.ndarray:
    """One row, the plain way: every token of the vocabulary, in vLLM's order."""
    out = row.astype(np.float32).copy()
    for token_id, bias in a.logit_bias:
        out[token_id] += np.float32(bias)
    out[list(a.masked_token_ids)] = -np.inf
    if a.repetition_penalty != 1.0:
        p = np.float32(a.repetition_penalty)
        seen = sorted(set(a.prompt_token_ids) | set(a.output_token_ids))
        out[seen] = np.where(out[seen] > 0, out[seen] / p, out[seen] * p)
    counts = np.bincount(np.asarray(a.output_token_ids, dtype=np.int64), minlength=len(row))
    touched = counts > 0
    out[touched] -= np.float32(a.frequency_penalty) * counts[touched].astype(np.float32)
    out[touched] -= np.float32(a.presence_penalty)
    return out


def random_adjust(rng: np.random.Generator) -> LogitsAdjust | None:
    if rng.random() < 0.25:
        return None
    outputs = tuple(int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, 40))))
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, VOCAB, 3)}
    return LogitsAdjust(
        presence_penalty=float(rng.choice([0.0, 0.5, -1.25])),
        frequency_penalty=float(rng.choice([0.0, 0.3, 2.0])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.7])),
        logit_bias=tuple(sorted(bias.items())) if rng.random() < 0.5 else (),
        output_token_ids=outputs,
        prompt_token_ids=tuple(int(t) for t in rng.integers(0, VOCAB, 20)),
        masked_token_ids=(0, 5) if rng.random() < 0.3 else (),
    )


@pytest.mark.parametrize("seed", range(5))
def test_batched_adjustments_equal_the_dense_reference_row_by_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (9, VOCAB)).astype(np.float32)
    raw = logits.copy()
    adjusts = [random_adjust(rng) for _ in range(9)]
    adjusts[0] = LogitsAdjust(repetition_penalty=1.5, output_token_ids=(3, 3, 4))
    out = adjust_logits(logits, adjusts)
    np.testing.assert_array_equal(logits, raw)  # the raw logits (logprobs) are never written
    for row, a in enumerate(adjusts):
        expected = raw[row] if a is None else dense_reference(raw[row], a)
        np.testing.assert_array_equal(out[row], expected)


def test_no_adjustment_is_the_same_array() -> None:
    logits = np.zeros((2, VOCAB), dtype=np.float32)
    assert adjust_logits(logits, [None, None]) is logits
    assert logits_adjust(SamplingParams(), lambda: (1, 2), (3,), (0,)) is None


def test_min_tokens_masks_stop_and_eos_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(7,))
    assert logits_adjust(params, lambda: (1,), (), (0,)).masked_token_ids == (7, 0)
    assert logits_adjust(params, lambda: (1,), (9,), (0,)).masked_token_ids == (7, 0)
    assert logits_adjust(params, lambda: (1,), (9, 9), (0,)) is None
    ignoring = dataclasses.replace(params, ignore_eos=True)
    assert logits_adjust(ignoring, lambda: (1,), (), (0,)).masked_token_ids == (7,)


def test_penalties_read_outputs_and_repetition_reads_the_prompt_too() -> None:
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2)
    a = logits_adjust(params, lambda: (1, 2), (3,), (0,))
    assert (a.prompt_token_ids, a.output_token_ids) == ((1, 2), (3,))
    only_presence = logits_adjust(SamplingParams(presence_penalty=0.5), lambda: (1, 2), (3,), (0,))
    assert (only_presence.prompt_token_ids, only_presence.output_token_ids) == ((), (3,))


def test_greedy_follows_the_adjusted_logits() -> None:
    logits = np.array([[0.0, 3.0, 2.9, 1.0]], dtype=np.float32)
    spec = SampleSpec(0.0, 1.0, 0, 0, 5)
    assert sample(logits, [spec]) == [1]
    penalized = dataclasses.replace(
        spec, adjust=LogitsAdjust(presence_penalty=0.5, output_token_ids=(1,))
    )
    assert sample(logits, [penalized]) == [2]
    biased = dataclasses.replace(spec, adjust=LogitsAdjust(logit_bias=((3, 5.0),)))
    assert sample(logits, [biased]) == [3]


def test_min_p_keeps_tokens_at_least_min_p_as_likely_as_the_best() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125]], dtype=np.float32))
    drawn = {sample(logits, [SampleSpec(1.0, 1.0, 0, s, 3, min_p=0.4)])[0] for s in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"min_tokens": 20}, "min_tokens must be in"),
        ({"logit_bias": ((VOCAB, 1.0),)}, f"token id {VOCAB}"),
        ({"min_tokens": 1, "stop_token_ids": (VOCAB + 3,)}, f"token id {VOCAB + 3}"),
    ],
)
def test_settings_the_engine_cannot_apply_are_refused(change: dict, message: str) -> None:
    params = dataclasses.replace(SamplingParams(max_tokens=16), **change)
    with pytest.raises(ValueError, match=message):
        check_params(params, VOCAB, "r")


# ---- the engine: P's first token and D's rest equal one mixed engine ------------------------


def make_engine() -> LLMEngine:
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    return LLMEngine(NumpyRunner(64, 4), CharTokenizer(), config, vocab_size=VOCAB)


def penalized_greedy(prompt: list[int], params: SamplingParams) -> list[int]:
    """The numpy stand-in's greedy tokens under params' adjustments, computed densely."""
    outputs: list[int] = []
    for _ in range(params.max_tokens):
        target = next_token(prompt + outputs, VOCAB)
        row = (-0.5 * np.abs(np.arange(VOCAB) - target)).astype(np.float32)
        a = logits_adjust(params, lambda: prompt, outputs, (0,))
        outputs.append(int(np.argmax(row if a is None else dense_reference(row, a))))
    return outputs


def run_split(prompt: tuple[int, ...], params: SamplingParams) -> list[int]:
    """P samples the first token on one engine, D the rest on another over P's KV."""
    prefill = make_engine()
    prefill.add_request(EngineRequest("p", prompt, params, prefill_only=True))
    (first,) = prefill.step()
    decode = make_engine()
    block_ids = decode.allocate_blocks(len(first.block_ids))
    decode.runner.write(block_ids, prefill.runner.read(first.block_ids, len(prompt)))
    decode.add_request(
        EngineRequest(
            "d",
            prompt,
            params,
            output_token_ids=first.new_token_ids,
            preallocated_block_ids=tuple(block_ids),
            num_computed_tokens=len(prompt),
        )
    )
    outputs = [first]
    while decode.has_unfinished():
        outputs.extend(decode.step())
    return tokens_of(outputs)


CONTROLS = [
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.4, presence_penalty=0.3),
    SamplingParams(
        max_tokens=12, temperature=0.0, repetition_penalty=1.8, logit_bias=((40, 2.0), (41, -3.0))
    ),
    SamplingParams(
        max_tokens=12,
        temperature=0.9,
        seed=7,
        frequency_penalty=1.0,
        min_p=0.1,
        top_k=20,
        repetition_penalty=1.3,
        min_tokens=4,
    ),
]


@pytest.mark.parametrize("params", CONTROLS, ids=["penalties", "repetition+bias", "seeded"])
def test_prefill_and_decode_on_two_engines_equal_one_engine(params: SamplingParams) -> None:
    prompt = tuple(97 + (i * 5) % 11 for i in range(9))
    mixed = tokens_of(make_engine().generate([EngineRequest("m", prompt, params)])["m"])
    plain = dataclasses.replace(
        params, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, logit_bias=()
    )
    unadjusted = tokens_of(make_engine().generate([EngineRequest("m", prompt, plain)])["m"])
    assert mixed != unadjusted  # the adjustments change the answer
    assert run_split(prompt, params) == mixed
    if params.temperature == 0.0:
        assert mixed == penalized_greedy(list(prompt), params)


def test_min_tokens_holds_off_eos_through_the_engine() -> None:
    # A logit bias makes eos (0) the greedy choice from the first token on.
    eager = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((0, 100.0),))
    prompt = (97, 98, 99)
    assert tokens_of(make_engine().generate([EngineRequest("e", prompt, eager)])["e"]) == [0]
    held = dataclasses.replace(eager, min_tokens=3)
    tokens = tokens_of(make_engine().generate([EngineRequest("h", prompt, held)])["h"])
    assert len(tokens) == 4 and tokens[3] == 0 and 0 not in tokens[:3]
    assert run_split(prompt, held) == tokens
