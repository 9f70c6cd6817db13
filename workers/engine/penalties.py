"""Logits adjustments before sampling: bias, min_tokens, and the three penalties, batched.

One step's rows are adjusted together (`adjust_logits`), each by its own `LogitsAdjust`, in
vLLM's order:

    logit_bias           logits[t] += bias[t]
    min_tokens           logits[stop token] = -inf while fewer than min_tokens outputs exist
                         (the stop_token_ids, and eos unless ignore_eos)
    repetition_penalty   every token of prompt + outputs: logits[t] / p if > 0, else * p
    frequency_penalty    logits[t] -= f * count of t in the outputs
    presence_penalty     logits[t] -= p if t is in the outputs

The outputs are every token generated so far, those given at add time included: a decode
worker's request carries the prefill worker's first token, so the penalties on D count it
exactly as a mixed worker does, and a seeded or greedy request samples the same tokens either
way. Only the (row, token) pairs a row touches are read and written: the work is linear in
the tokens involved, not in rows x vocabulary. The raw logits are never written (logprobs
report them, as vLLM does by default): the adjusted rows go to a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from workers.engine.api import SamplingParams


@dataclass(frozen=True, eq=False)
class LogitsAdjust:
    """One row's adjustments and the token history its penalties read."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    output_token_ids: tuple[int, ...] = ()
    # The prompt's distinct token ids (distinct_ids), read by repetition_penalty only.
    prompt_token_ids: np.ndarray | Sequence[int] = ()
    masked_token_ids: tuple[int, ...] = ()  # set to -inf (stop tokens before min_tokens)

    @property
    def penalizes_outputs(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def distinct_ids(token_ids: Sequence[int]) -> np.ndarray:
    """The distinct ids of token_ids, sorted: a prompt's, made once per request (repeated
    every step, the conversion and the sort would cost more than the penalty itself)."""
    return np.unique(np.asarray(token_ids, dtype=np.int64))


def logits_adjust(
    params: SamplingParams,
    prompt_token_ids: Callable[[], np.ndarray | Sequence[int]],
    output_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
) -> LogitsAdjust | None:
    """The adjustments of the next token of a request; None when there are none (the common
    case costs the sampler nothing). prompt_token_ids gives the prompt's distinct ids, asked
    only for repetition_penalty."""
    num_outputs = len(output_token_ids)
    masked: tuple[int, ...] = ()
    if num_outputs < params.min_tokens:
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        masked = (*params.stop_token_ids, *eos)
    penalizes = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    repeats = params.repetition_penalty != 1.0
    if not (penalizes or repeats or params.logit_bias or masked):
        return None
    return LogitsAdjust(
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias,
        output_token_ids=tuple(output_token_ids) if penalizes or repeats else (),
        prompt_token_ids=prompt_token_ids() if repeats else (),
        masked_token_ids=masked,
    )


def check_params(params: SamplingParams, vocab_size: int | None, request_id: str) -> None:
    """Raise ValueError naming the first adjustment setting the engine cannot apply."""
    where = f"request {request_id!r}"
    if not params.repetition_penalty > 0.0:
        raise ValueError(
            f"{where}: repetition_penalty must be > 0, got {params.repetition_penalty}"
        )
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"{where}: min_p must be in [0, 1], got {params.min_p}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(
            f"{where}: min_tokens must be in [0, max_tokens={params.max_tokens}], "
            f"got {params.min_tokens}"
        )
    token_ids = [t for t, _ in params.logit_bias]
    if params.min_tokens > 0:
        token_ids += params.stop_token_ids  # masked by id: they must exist
    bad = [t for t in token_ids if not 0 <= t < (vocab_size or 2**63)]
    if bad:
        raise ValueError(
            f"{where}: token id {bad[0]} (logit_bias or stop_token_ids) outside the "
            f"vocabulary [0, {vocab_size})"
        )


def adjust_logits(logits: np.ndarray, adjusts: Sequence[LogitsAdjust | None]) -> np.ndarray:
    """logits ([num_rows, vocab_size]) with adjusts[row] applied to each row: a new array
    when any row has adjustments, else logits itself."""
    rows = [(row, a) for row, a in enumerate(adjusts) if a is not None]
    if not rows:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)  # [num_rows, vocab_size]
    vocab_size = out.shape[1]
    bias = [(row, a.logit_bias) for row, a in rows if a.logit_bias]
    if bias:
        r, c = _pairs((row, [t for t, _ in b]) for row, b in bias)
        out[r, c] += np.concatenate(
            [np.array([v for _, v in b], dtype=np.float32) for _, b in bias]
        )
    masked = [(row, a.masked_token_ids) for row, a in rows if a.masked_token_ids]
    if masked:
        out[_pairs(masked)] = -np.inf
    repeating = [(row, a) for row, a in rows if a.repetition_penalty != 1.0]
    if repeating:
        r, c = _seen_pairs(repeating, vocab_size)
        penalty = np.ones(len(adjusts), dtype=np.float32)
        penalty[[row for row, _ in repeating]] = [a.repetition_penalty for _, a in repeating]
        values = out[r, c]
        out[r, c] = np.where(values > 0, values / penalty[r], values * penalty[r])
    penalizing = [(row, a) for row, a in rows if a.penalizes_outputs]
    if penalizing:
        r, c, counts = _unique_pairs(
            ((row, a.output_token_ids) for row, a in penalizing), vocab_size
        )
        frequency = np.zeros(len(adjusts), dtype=np.float32)
        presence = np.zeros(len(adjusts), dtype=np.float32)
        for row, a in penalizing:
            frequency[row], presence[row] = a.frequency_penalty, a.presence_penalty
        out[r, c] -= frequency[r] * counts.astype(np.float32)
        out[r, c] -= presence[r]
    return out


def _pairs(rows: Iterable[tuple[int, Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, token ids) of every (row, token) pair, as index arrays."""
    rows = list(rows)
    r = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids in rows])
    c = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in rows])
    return r, c


def _seen_pairs(
    rows: Sequence[tuple[int, LogitsAdjust]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs of each row's prompt and outputs. The prompts' parts
    arrive sorted (distinct_ids, rows in order), so a stable (merge) sort of them with the
    few outputs costs little more than a pass."""
    parts = [row * vocab_size + np.asarray(a.prompt_token_ids, dtype=np.int64) for row, a in rows]
    parts += [row * vocab_size + np.asarray(a.output_token_ids, dtype=np.int64) for row, a in rows]
    flat = np.concatenate(parts)
    flat.sort(kind="stable")
    flat = flat[np.concatenate(([True], flat[1:] != flat[:-1]))] if len(flat) else flat
    return flat // vocab_size, flat % vocab_size


def _unique_pairs(
    rows: Iterable[tuple[int, Sequence[int]]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs as (row indices, token ids, occurrences of each)."""
    r, c = _pairs(rows)
    flat, counts = np.unique(r * vocab_size + c, return_counts=True)
    return flat // vocab_size, flat % vocab_size, counts
