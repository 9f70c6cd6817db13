"""least_loaded and power_of_two over plain Instances; load held by admission.Hold."""

from __future__ import annotations

import random

import pytest

from pdrouter.router.instances.instance import Instance
from pdrouter.router.selection.admission import Hold
from pdrouter.router.selection.policies import LeastLoaded, PowerOfTwo, make_policy


def _instances(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)]


def _load(insts: list[Instance], loads: list[tuple[int, int]]) -> None:
    for inst, (requests, tokens) in zip(insts, loads, strict=True):
        inst.in_flight, inst.in_flight_tokens = requests, tokens


def test_least_loaded_orders_by_requests_then_tokens_then_list_order() -> None:
    insts = _instances(3)
    _load(insts, [(2, 10), (1, 500), (1, 400)])
    assert LeastLoaded().pick(insts) is insts[2]
    _load(insts, [(1, 400), (1, 500), (1, 400)])
    assert LeastLoaded().pick(insts) is insts[0]
    _load(insts, [(0, 0), (0, 0), (0, 0)])
    assert LeastLoaded().pick(insts) is insts[0]


def test_least_loaded_sees_load_until_the_hold_ends() -> None:
    insts = _instances(2)
    policy = LeastLoaded()
    with Hold(insts[0], 100):
        assert (insts[0].in_flight, insts[0].in_flight_tokens) == (1, 100)
        assert policy.pick(insts) is insts[1]
        with Hold(insts[1], 30):
            assert policy.pick(insts) is insts[1]  # same requests, fewer tokens
        assert (insts[1].in_flight, insts[1].in_flight_tokens) == (0, 0)
    assert [(i.in_flight, i.in_flight_tokens) for i in insts] == [(0, 0), (0, 0)]


def test_hold_gives_back_on_error() -> None:
    inst = _instances(1)[0]
    with pytest.raises(RuntimeError), Hold(inst, 7):
        raise RuntimeError("call failed")
    assert (inst.in_flight, inst.in_flight_tokens) == (0, 0)


def test_power_of_two_draws_two_distinct_and_takes_the_less_loaded() -> None:
    insts = _instances(4)
    _load(insts, [(3, 0), (0, 0), (2, 0), (1, 0)])
    seed = 1234
    draws = random.Random(seed)
    policy = PowerOfTwo(random.Random(seed))
    for _ in range(50):
        a, b = draws.sample(range(4), 2)
        assert a != b
        expected = insts[b] if insts[b].in_flight < insts[a].in_flight else insts[a]
        assert policy.pick(insts) is expected


def test_power_of_two_never_picks_the_most_loaded_of_many() -> None:
    insts = _instances(5)
    _load(insts, [(9, 0), (1, 0), (1, 0), (1, 0), (1, 0)])
    policy = PowerOfTwo(random.Random(7))
    picks = [policy.pick(insts) for _ in range(200)]
    assert insts[0] not in picks
    assert {p.url for p in picks} == {i.url for i in insts[1:]}


def test_power_of_two_tie_keeps_the_first_drawn_and_one_candidate_is_returned() -> None:
    insts = _instances(2)
    policy = PowerOfTwo(random.Random(3))
    first_drawn = random.Random(3).sample(range(2), 2)[0]
    assert policy.pick(insts) is insts[first_drawn]
    assert PowerOfTwo(random.Random(0)).pick(insts[:1]) is insts[0]
    with pytest.raises(ValueError, match=r"PowerOfTwo\.pick needs at least one candidate"):
        PowerOfTwo().pick([])


def test_make_policy_knows_every_name() -> None:
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("power_of_two"), PowerOfTwo)
    known = "known: cache_aware, least_in_flight, least_loaded, power_of_two"
    with pytest.raises(ValueError, match=known):
        make_policy("random")
