"""Sampler: greedy ties, reproducibility per (seed, position), top_k/top_p support."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.sampler import SampleSpec, sample, sample_row


def spec(temperature=1.0, top_p=1.0, top_k=0, seed=7, position=0) -> SampleSpec:
    return SampleSpec(temperature, top_p, top_k, seed, position)


def logits_from_probs(probs: list[float]) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float32))


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    row = np.array([0.5, 2.0, 1.0, 2.0], dtype=np.float32)
    assert sample_row(row, spec(temperature=0.0)) == 1
    flat = np.zeros(5, dtype=np.float32)
    assert sample_row(flat, spec(temperature=0.0)) == 0


def test_same_seed_and_position_give_the_same_token() -> None:
    row = logits_from_probs([0.25, 0.25, 0.25, 0.25])
    for position in range(50):
        first = sample_row(row, spec(seed=123, position=position))
        assert sample_row(row, spec(seed=123, position=position)) == first


def test_draws_follow_the_distribution_over_positions() -> None:
    probs = [0.5, 0.3, 0.2]
    row = logits_from_probs(probs)
    num_draws = 6000
    drawn = [sample_row(row, spec(seed=1, position=p)) for p in range(num_draws)]
    counts = np.bincount(drawn, minlength=3) / num_draws
    # Fixed seeds make this deterministic; 0.03 is about 5 standard deviations at n=6000.
    np.testing.assert_allclose(counts, probs, atol=0.03)


def test_different_seeds_give_different_sequences() -> None:
    row = logits_from_probs([0.25, 0.25, 0.25, 0.25])
    seq_a = [sample_row(row, spec(seed=1, position=p)) for p in range(32)]
    seq_b = [sample_row(row, spec(seed=2, position=p)) for p in range(32)]
    assert seq_a != seq_b
    assert set(seq_a) == {0, 1, 2, 3}


def test_top_k_restricts_to_the_k_most_likely() -> None:
    row = logits_from_probs([0.1, 0.4, 0.15, 0.35])
    drawn = {sample_row(row, spec(top_k=2, position=p)) for p in range(300)}
    assert drawn == {1, 3}
    assert {sample_row(row, spec(top_k=1, temperature=5.0, position=p)) for p in range(50)} == {1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    row = logits_from_probs([0.1, 0.4, 0.2, 0.3])
    # Sorted: 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1). Mass before 3 is 0.4 < 0.5: kept; before 2
    # it is 0.7: dropped.
    drawn = {sample_row(row, spec(top_p=0.5, position=p)) for p in range(300)}
    assert drawn == {1, 3}
    # A tiny top_p still keeps the single most likely token.
    assert {sample_row(row, spec(top_p=1e-6, position=p)) for p in range(50)} == {1}


def test_low_temperature_concentrates_on_the_argmax() -> None:
    row = logits_from_probs([0.3, 0.36, 0.34])
    drawn = {sample_row(row, spec(temperature=0.01, position=p)) for p in range(200)}
    assert drawn == {1}


def test_batch_rows_are_sampled_independently() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    specs = [
        spec(seed=3, position=10),
        spec(temperature=0.0),
        spec(top_k=5, seed=4, position=11),
        spec(top_p=0.9, seed=5, position=12),
    ]
    together = sample(logits, specs)
    alone = [sample_row(logits[i], s) for i, s in enumerate(specs)]
    assert together == alone
    assert together[1] == int(np.argmax(logits[1]))


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="num_rows == 2 specs"):
        sample(np.zeros((3, 4), dtype=np.float32), [spec(), spec()])
