"""policies.choose and selection.Selector: tiers, open breakers, per-instance limits, probes."""

from __future__ import annotations

import pytest

from pdrouter.router.instances.instance import Instance
from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.admission import Admission, AdmissionConfig
from pdrouter.router.selection.breaker import BreakerBoard, BreakerConfig, BreakerState
from pdrouter.router.selection.policies import BreakerBusy, LeastLoaded, RoundRobin, choose
from pdrouter.router.selection.selector import Selector
from pdrouter.wire.errors import APIError


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _insts(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)]


def _board(
    clock: FakeClock, threshold: int = 1, cooldown_s: float = 10.0, trials: int = 1
) -> BreakerBoard:
    return BreakerBoard(BreakerConfig(threshold, cooldown_s, trials), clock)


def test_open_breakers_are_skipped_and_the_next_tier_is_used() -> None:
    clock = FakeClock()
    board = _board(clock)
    healthy, down = _insts(2)
    board.get(healthy.url).record_failure()
    adm = Admission(AdmissionConfig())
    picked = choose("decode", [[healthy], [down]], RoundRobin(), board, adm, True)
    assert picked is down


def test_every_breaker_open_is_503_on_the_first_attempt_and_none_after() -> None:
    clock = FakeClock()
    board = _board(clock, cooldown_s=7.5)
    insts = _insts(2)
    for inst in insts:
        board.get(inst.url).record_failure()
    adm = Admission(AdmissionConfig())
    with pytest.raises(APIError) as info:
        choose("prefill", [insts], RoundRobin(), board, adm, True)
    err = info.value
    assert (err.status, err.stage, err.retry_after_s) == (503, "prefill", 8)
    assert not isinstance(err, BreakerBusy)  # open on instances not healthy: nothing to wait for
    assert "circuit breaker of every prefill instance is open" in err.message
    assert choose("prefill", [insts], RoundRobin(), board, adm, False) is None
    assert choose("prefill", [[], []], RoundRobin(), board, adm, True) is None


def test_after_the_cooldown_exactly_half_open_calls_requests_try() -> None:
    clock = FakeClock()
    board = _board(clock, cooldown_s=10.0, trials=2)
    (inst,) = _insts(1)
    board.get(inst.url).record_failure()
    adm = Admission(AdmissionConfig())
    clock.now_s = 10.0
    assert choose("decode", [[inst]], RoundRobin(), board, adm, True) is inst
    assert choose("decode", [[inst]], RoundRobin(), board, adm, True) is inst
    assert board.state(inst.url) is BreakerState.HALF_OPEN
    with pytest.raises(BreakerBusy) as info:  # both trials out: the next one may wait
        choose("decode", [[inst]], RoundRobin(), board, adm, True)
    assert info.value.status == 503


def test_open_on_a_healthy_instance_is_worth_waiting_for() -> None:
    clock = FakeClock()
    board = _board(clock, cooldown_s=60.0)
    (inst,) = _insts(1)
    board.get(inst.url).record_failure()
    adm = Admission(AdmissionConfig())
    inst.healthy = True  # the checks call it healthy: the next passed check half-opens it
    with pytest.raises(BreakerBusy):
        choose("decode", [[inst]], RoundRobin(), board, adm, True)


def test_full_instances_are_429_and_one_with_room_is_picked() -> None:
    clock = FakeClock()
    board = _board(clock)
    insts = _insts(3)
    adm = Admission(AdmissionConfig(max_in_flight_per_instance=2))
    insts[0].in_flight, insts[1].in_flight, insts[2].in_flight = 2, 1, 2
    assert choose("decode", [insts], LeastLoaded(), board, adm, True) is insts[1]
    insts[1].in_flight = 2
    with pytest.raises(APIError) as info:
        choose("decode", [insts], LeastLoaded(), board, adm, True)
    assert (info.value.status, info.value.stage) == (429, "decode")
    assert adm.num_rejected == 1


def test_selector_verdicts_drive_the_breaker_and_ensure_room() -> None:
    clock = FakeClock()
    reg = Registry(["http://127.0.0.1:9000"], ["http://127.0.0.1:9100"])
    d = reg.decode[0]
    d.healthy = True
    adm = Admission(AdmissionConfig(max_in_flight_per_instance=1))
    board = _board(clock, threshold=2)
    sel = Selector(reg, {"prefill": RoundRobin(), "decode": RoundRobin()}, board, adm)
    sel.verdict(d, True)
    assert board.get(d.url).consecutive_failures == 1
    sel.verdict(d, None)  # no verdict: a client that left says nothing about the instance
    sel.verdict(d, False)
    assert board.get(d.url).consecutive_failures == 0
    sel.ensure_room("decode")
    d.in_flight = 1
    with pytest.raises(APIError) as info:
        sel.ensure_room("decode")
    assert info.value.status == 429
    assert sel.pick("prefill", set()) is reg.prefill[0]  # prefill has no limit reached
