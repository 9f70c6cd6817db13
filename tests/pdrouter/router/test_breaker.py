"""CircuitBreaker and BreakerBoard: exact state transitions under an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from pdrouter.router.selection.breaker import (
    BreakerBoard,
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _breaker(
    threshold: int = 3, cooldown_s: float = 10.0, trials: int = 1
) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerConfig(threshold, cooldown_s, trials), clock), clock


def test_opens_after_exactly_n_consecutive_failures() -> None:
    br, _ = _breaker(threshold=3)
    for expected_failures in (1, 2):
        assert br.allow()
        br.record_failure()
        assert (br.state, br.consecutive_failures) == (BreakerState.CLOSED, expected_failures)
    br.record_failure()
    assert br.state is BreakerState.OPEN
    assert (br.opened_at_s, br.times_opened) == (100.0, 1)
    assert not br.allow() and not br.available()


def test_a_success_resets_the_consecutive_count() -> None:
    br, _ = _breaker(threshold=3)
    br.record_failure()
    br.record_failure()
    br.record_success()
    assert (br.state, br.consecutive_failures) == (BreakerState.CLOSED, 0)
    br.record_failure()
    br.record_failure()
    assert br.state is BreakerState.CLOSED


def test_half_open_after_cooldown_lets_exactly_half_open_calls_trials() -> None:
    br, clock = _breaker(threshold=1, cooldown_s=10.0, trials=3)
    br.record_failure()
    assert br.state is BreakerState.OPEN
    clock.now_s = 109.999
    assert not br.allow()
    clock.now_s = 110.0
    assert br.available()
    assert br.allow() and br.allow() and br.allow()  # three trials
    assert (br.state, br.trials_in_flight) == (BreakerState.HALF_OPEN, 3)
    assert not br.allow() and not br.available()  # a fourth waits for a slot
    br.release_trial()
    assert br.trials_in_flight == 2 and br.allow()


def test_a_passed_health_check_half_opens_before_the_cooldown() -> None:
    br, clock = _breaker(threshold=1, cooldown_s=60.0, trials=2)
    br.record_failure()
    clock.now_s = 101.0
    assert br.state is BreakerState.OPEN and not br.available()
    br.health_passed()
    assert (br.state, br.trials_in_flight) == (BreakerState.HALF_OPEN, 0)
    assert br.allow() and br.allow() and not br.allow()
    br.health_passed()  # already half-open: its trials stay counted
    assert br.trials_in_flight == 2
    br.record_success()
    assert br.state is BreakerState.CLOSED
    br.health_passed()  # closed stays closed
    assert br.state is BreakerState.CLOSED


def test_probe_success_closes() -> None:
    br, clock = _breaker(threshold=1, cooldown_s=1.0)
    br.record_failure()
    clock.now_s += 1.0
    assert br.allow()
    br.record_success()
    assert (br.state, br.consecutive_failures, br.opened_at_s) == (BreakerState.CLOSED, 0, None)
    assert br.allow() and br.allow()


def test_probe_failure_reopens_with_a_fresh_cooldown() -> None:
    br, clock = _breaker(threshold=2, cooldown_s=5.0)
    br.record_failure()
    br.record_failure()
    clock.now_s = 105.0
    assert br.allow()
    br.record_failure()  # one failure in half-open is enough
    assert (br.state, br.opened_at_s, br.times_opened) == (BreakerState.OPEN, 105.0, 2)
    clock.now_s = 109.0
    assert not br.allow()
    clock.now_s = 110.0
    assert br.allow()


def test_released_trial_lets_the_next_request_try() -> None:
    br, _ = _breaker(threshold=1, cooldown_s=0.0)
    br.record_failure()
    assert br.allow() and not br.allow()
    br.release_trial()
    assert br.allow()


async def test_board_wakes_waiters_when_a_trial_slot_frees() -> None:
    clock = FakeClock()
    board = BreakerBoard(BreakerConfig(1, 60.0, 1), clock)
    br = board.get("http://a")
    br.record_failure()
    assert not await board.wait_for_change(0.01)  # open, nothing happens: times out
    waiter = asyncio.ensure_future(board.wait_for_change(30.0))
    await asyncio.sleep(0)
    board.health_passed("http://a")  # half-open: a waiter may try
    assert await waiter
    assert br.allow()
    waiter = asyncio.ensure_future(board.wait_for_change(30.0))
    await asyncio.sleep(0)
    br.release_trial()
    assert await waiter


def test_late_failure_while_open_keeps_the_cooldown() -> None:
    br, clock = _breaker(threshold=1, cooldown_s=10.0)
    br.record_failure()
    clock.now_s = 105.0
    br.record_failure()  # a call that started before the breaker opened
    assert (br.state, br.opened_at_s, br.times_opened) == (BreakerState.OPEN, 100.0, 1)


def test_board_makes_one_breaker_per_url_and_forgets() -> None:
    clock = FakeClock()
    board = BreakerBoard(BreakerConfig(1, 10.0), clock)
    assert board.state("http://a") is BreakerState.CLOSED
    board.get("http://a").record_failure()
    assert board.get("http://a") is board.get("http://a")
    assert board.state("http://a") is BreakerState.OPEN
    assert board.state("http://b") is BreakerState.CLOSED
    clock.now_s = 110.0
    assert board.state("http://a") is BreakerState.HALF_OPEN
    board.forget("http://a")
    assert board.state("http://a") is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("threshold", "cooldown_s", "trials", "wait_s"),
    [(0, 1.0, 1, 0.0), (1, -1.0, 1, 0.0), (1, 1.0, 0, 0.0), (1, 1.0, 1, -1.0)],
)
def test_config_refuses_nonsense(
    threshold: int, cooldown_s: float, trials: int, wait_s: float
) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(threshold, cooldown_s, trials, wait_s)
