"""Token sampling on the runner's float32 logits, in numpy.

Randomness is a pure function of (seed, position of the token being sampled): each draw
builds its own Philox generator keyed by that pair. So a seeded request samples the same
tokens whatever else shares its batch, after a preemption (recompute), and when its prefill
and decode run in different processes. Greedy (temperature == 0) is argmax, ties to the
lowest token id.

Non-greedy order of operations: logits / temperature -> top_k -> top_p (nucleus: the
smallest set of most likely tokens whose mass reaches top_p, at least one) -> one uniform
draw mapped through the kept tokens' cumulative distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_UINT64_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SampleSpec:
    """One logits row's sampling settings and the absolute position of the sampled token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    position: int


def sample(logits: np.ndarray, specs: Sequence[SampleSpec]) -> list[int]:
    """Sample one token id per row of logits ([num_rows, vocab_size]) with specs[row]."""
    if logits.ndim != 2 or logits.shape[0] != len(specs):
        raise ValueError(
            f"sample() needs logits [num_rows, vocab] with num_rows == {len(specs)} specs, "
            f"got shape {tuple(logits.shape)}"
        )
    return [sample_row(logits[row], spec) for row, spec in enumerate(specs)]


def sample_row(logits_row: np.ndarray, spec: SampleSpec) -> int:
    """Sample one token id from one row of logits ([vocab_size])."""
    if spec.temperature == 0.0:
        return int(np.argmax(logits_row))
    scaled = logits_row.astype(np.float64) / spec.temperature
    truncate = spec.top_k > 0 or spec.top_p < 1.0
    if truncate:
        # Stable sort of the negated logits: descending, equal logits keep lowest id first.
        candidate_ids = np.argsort(-scaled, kind="stable")
        if spec.top_k > 0:
            candidate_ids = candidate_ids[: spec.top_k]
        probs = _softmax(scaled[candidate_ids])
        if spec.top_p < 1.0:
            mass_before = np.cumsum(probs) - probs
            num_kept = max(int(np.count_nonzero(mass_before < spec.top_p)), 1)
            candidate_ids = candidate_ids[:num_kept]
            probs = probs[:num_kept]
    else:
        candidate_ids = None
        probs = _softmax(scaled)
    cdf = np.cumsum(probs)
    draw = _generator(spec.seed, spec.position).random() * cdf[-1]
    index = min(int(np.searchsorted(cdf, draw, side="right")), len(cdf) - 1)
    return int(candidate_ids[index]) if candidate_ids is not None else index


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _generator(seed: int, position: int) -> np.random.Generator:
    key = np.array([seed & _UINT64_MASK, position & _UINT64_MASK], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key))
