"""What a request's context says of its answer once answered: its time per output token,
over its longest sequence when it has several (they decode side by side)."""

from __future__ import annotations

import pytest

from pdrouter.router.orchestrator.context import RequestContext


@pytest.mark.parametrize(
    ("num_output_tokens", "num_sequence_tokens", "tpot_s"),
    [
        (15, 0, 0.5 / 7),  # one sequence: every output token
        (15, 5, 0.25),  # n=3 of 5 tokens each: the longest sequence's 5, not the 15
        (3, 1, None),  # three sequences of one token: no gap to measure
        (1, 0, None),
    ],
)
def test_time_per_output_token_is_its_longest_sequence_s(
    num_output_tokens: int, num_sequence_tokens: int, tpot_s: float | None
) -> None:
    ctx = RequestContext("r", "completions", b"{}", "m", False, arrival_s=0.0)
    ctx.answered(40, num_output_tokens, first_token_s=1.0, now_s=2.0)
    ctx.num_sequence_tokens = num_sequence_tokens
    assert ctx.time_per_output_token_s() == tpot_s
