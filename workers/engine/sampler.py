"""Token sampling on the runner's float32 logits, in numpy.

Randomness is a pure function of (seed, position of the token being sampled): each draw
builds its own Philox generator keyed by that pair. So a seeded request samples the same
tokens whatever else shares its batch, after a preemption (recompute), and when its prefill
and decode run in different processes. Greedy (temperature == 0) is argmax, ties to the
lowest token id.

Each row's logits are first adjusted (workers.engine.penalties: logit_bias, min_tokens,
penalties), greedy or not. Non-greedy order of operations: logits / temperature -> min_p (the
tokens at least min_p times as likely as the most likely one) -> top_k -> top_p (nucleus: the
smallest set of most likely tokens whose mass reaches top_p, at least one) -> one uniform
draw mapped through the kept tokens' cumulative distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from workers.engine.penalties import LogitsAdjust, adjust_logits, distinct_ids, logits_adjust

if TYPE_CHECKING:
    from workers.engine.request_state import RequestState

_UINT64_MASK = (1 << 64) - 1
# Tokens sorted first when looking for a top_p nucleus; most nuclei fit well within it.
_NUCLEUS_HEAD = 256


@dataclass(frozen=True)
class SampleSpec:
    """One logits row's sampling settings and the absolute position of the sampled token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    position: int
    num_logprobs: int | None = None  # report logprobs (workers.engine.logprobs); None: not
    min_p: float = 0.0
    adjust: LogitsAdjust | None = None  # workers.engine.penalties; None: none


def sample_spec(state: RequestState, position: int, eos_token_ids: Sequence[int]) -> SampleSpec:
    """The spec of the token a request samples at position: its settings, its seed, and the
    logits adjustments its history calls for (the prompt and every output so far)."""
    p = state.params

    def prompt_ids() -> np.ndarray:
        if state.distinct_prompt_ids is None:
            state.distinct_prompt_ids = distinct_ids(state.prompt_token_ids)
        return state.distinct_prompt_ids

    adjust = logits_adjust(p, prompt_ids, state.output_token_ids, eos_token_ids)
    return SampleSpec(
        p.temperature, p.top_p, p.top_k, state.seed, position, p.num_logprobs, p.min_p, adjust
    )


def sample(logits: np.ndarray, specs: Sequence[SampleSpec]) -> list[int]:
    """Sample one token id per row of logits ([num_rows, vocab_size]) with specs[row]."""
    if logits.ndim != 2 or logits.shape[0] != len(specs):
        raise ValueError(
            f"sample() needs logits [num_rows, vocab] with num_rows == {len(specs)} specs, "
            f"got shape {tuple(logits.shape)}"
        )
    logits = adjust_logits(logits, [spec.adjust for spec in specs])
    return [sample_row(logits[row], spec) for row, spec in enumerate(specs)]


def sample_row(logits_row: np.ndarray, spec: SampleSpec) -> int:
    """Sample one token id from one row of logits ([vocab_size])."""
    if spec.temperature == 0.0:
        return int(np.argmax(logits_row))
    scaled = logits_row.astype(np.float64) / spec.temperature
    if spec.min_p > 0.0:
        scaled = np.where(scaled - np.max(scaled) >= np.log(spec.min_p), scaled, -np.inf)
    if spec.top_k > 0 or spec.top_p < 1.0:
        candidate_ids, probs = _truncated(scaled, spec.top_k, spec.top_p)
    else:
        candidate_ids, probs = None, _softmax(scaled)
    cdf = np.cumsum(probs)
    draw = _generator(spec.seed, spec.position).random() * cdf[-1]
    index = min(int(np.searchsorted(cdf, draw, side="right")), len(cdf) - 1)
    return int(candidate_ids[index]) if candidate_ids is not None else index


def _truncated(scaled: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Kept token ids, most likely first (ties: lowest id first), and their probabilities."""
    vocab_size = len(scaled)
    if top_k > 0:
        candidate_ids = best_ids(scaled, top_k)
        probs = _softmax(scaled[candidate_ids])
    else:
        # Nucleus only: sort a short head of the distribution and fall back to the whole
        # vocabulary only if that head holds less than top_p of the mass (a full sort of a
        # 150k vocabulary per row costs ~10 ms; this is exact either way).
        exp = np.exp(scaled - np.max(scaled))
        total = exp.sum()
        candidate_ids = best_ids(scaled, min(vocab_size, _NUCLEUS_HEAD))
        probs = exp[candidate_ids] / total
        if probs.sum() < top_p and len(candidate_ids) < vocab_size:
            candidate_ids = best_ids(scaled, vocab_size)
            probs = exp[candidate_ids] / total
    if top_p < 1.0:
        mass_before = np.cumsum(probs) - probs
        num_kept = max(int(np.count_nonzero(mass_before < top_p)), 1)
        candidate_ids, probs = candidate_ids[:num_kept], probs[:num_kept]
    return candidate_ids, probs


def best_ids(scaled: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids ordered by (value descending, id ascending)."""
    if k >= len(scaled):
        return np.argsort(-scaled, kind="stable")
    threshold = scaled[np.argpartition(-scaled, k - 1)[k - 1]]
    above = np.flatnonzero(scaled > threshold)
    # Ties at the threshold: the lowest ids, so the result does not depend on the partition.
    at = np.flatnonzero(scaled == threshold)[: k - len(above)]
    ids = np.concatenate([above, at])
    return ids[np.lexsort((ids, -scaled[ids]))]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _generator(seed: int, position: int) -> np.random.Generator:
    key = np.array([seed & _UINT64_MASK, position & _UINT64_MASK], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key))
