"""Urgent requests' reserve (--urgent-reserve): slots beyond --max-in-flight and decode calls
beyond the decode bound that only urgent requests may take, without processes."""

from __future__ import annotations

import asyncio

import pytest

from pdrouter.router.selection.admission import Admission, AdmissionConfig
from pdrouter.router.tenancy.gate import TenancyConfig
from pdrouter.router.tenancy.queue import AdmissionQueue
from pdrouter.wire.errors import APIError
from tests.pdrouter.router.test_overload import _engine, _selector
from tests.pdrouter.router.test_tenancy import _turns

LOW, HIGH = 5, -1


def _queue(reserve: int) -> tuple[Admission, AdmissionQueue]:
    admission = Admission(AdmissionConfig(max_in_flight=2))
    return admission, AdmissionQueue(admission, 8, 10, urgent_reserve=reserve)


async def test_an_urgent_request_starts_past_a_limit_full_of_low_streams() -> None:
    admission, queue = _queue(reserve=1)
    await queue.enter(LOW)
    await queue.enter(LOW)  # the limit is full of low streams
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await queue.enter(priority)
        order.append(name)

    low3 = asyncio.ensure_future(wait("low3", LOW))
    await _turns()
    await queue.enter(HIGH)  # the reserve: at once, beside the waiting low request
    assert (admission.num_in_flight, queue.num_waiting, order) == (3, 1, [])
    high2 = asyncio.ensure_future(wait("high2", HIGH))  # the reserve is full: it waits
    await _turns()
    assert queue.num_waiting == 2
    queue.leave()  # a low stream ends: its slot is in the reserve's range, high2 takes it
    await _turns()
    assert (order, admission.num_in_flight) == (["high2"], 3)
    queue.leave()  # another ends: 2 left held, the limit: low3 may not take it
    await _turns()
    assert (order, admission.num_in_flight, queue.num_waiting) == (["high2"], 2, 1)
    queue.leave()  # an urgent one ends: below the limit now, low3 goes
    await asyncio.gather(low3, high2)
    assert (order, admission.num_in_flight, queue.num_waiting) == (["high2", "low3"], 2, 0)


async def test_without_a_reserve_an_urgent_request_waits_like_any() -> None:
    admission, queue = _queue(reserve=0)
    for _ in range(2):
        await queue.enter(LOW)
    high = asyncio.ensure_future(queue.enter(HIGH))
    await _turns()
    assert (high.done(), admission.num_in_flight, queue.num_waiting) == (False, 2, 1)
    queue.leave()
    await high
    assert (admission.num_in_flight, queue.num_waiting) == (2, 0)


async def test_the_reserve_is_for_urgent_priorities_only_and_refuses_past_it() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1))
    queue = AdmissionQueue(admission, 0, 10, urgent_reserve=2, urgent_priority=-3)
    await queue.enter(0)
    for priority in (-2, 0):  # not urgent enough: no queue, 429 at once
        with pytest.raises(APIError, match="--max-in-flight 1"):
            await queue.enter(priority)
    await queue.enter(-3)
    await queue.enter(-9)
    with pytest.raises(APIError) as info:
        await queue.enter(-9)  # the reserve is full too
    assert (info.value.status, admission.num_in_flight) == (429, 3)
    with pytest.raises(ValueError, match="urgent_reserve"):
        TenancyConfig(urgent_reserve=-1)


def test_the_reserve_raises_the_engine_bound_never_the_registered_capacity() -> None:
    adm = Admission(AdmissionConfig())
    assert adm.bound_of(_engine("http://d", capacity=256), extra_calls=3) == 8 + 3
    assert adm.bound_of(_engine("http://d", capacity=10), extra_calls=3) == 10
    per_instance = Admission(AdmissionConfig(max_in_flight_per_instance=5))
    assert per_instance.bound_of(_engine("http://d", capacity=256), extra_calls=2) == 7


def test_the_decode_door_lets_an_urgent_request_past_the_bound_by_its_reserve() -> None:
    sel, registry = _selector()
    queue = AdmissionQueue(sel.admission, 8, 10, urgent_reserve=2, urgent_priority=-1)
    sel.reserve_of = queue.extra_slots
    p, d = registry.prefill[0], registry.decode[0]
    d.in_flight, p.in_flight = 7, 1  # 8 of 8 calls, and the tokens full too
    d.in_flight_tokens = 4096
    for priority in (LOW, 0):  # not urgent: 429 at D's bound
        with pytest.raises(APIError):
            sel.ensure_room("decode", priority)
    sel.ensure_room("decode", HIGH)  # 8 of 10; the tokens not counted for it
    d.in_flight = 9
    with pytest.raises(APIError) as refused:
        sel.ensure_room("decode", HIGH)  # 10 of 10
    assert (refused.value.status, refused.value.stage) == (429, "decode")


def test_the_prefill_pick_lets_an_urgent_request_past_the_bound_by_its_reserve() -> None:
    sel, registry = _selector()
    queue = AdmissionQueue(sel.admission, 8, 10, urgent_reserve=2, urgent_priority=-1)
    sel.reserve_of = queue.extra_slots
    p = registry.prefill[0]
    p.in_flight, p.in_flight_tokens = 8, 4096  # 8 of 8 calls, and the tokens full too
    for priority in (LOW, 0):  # not urgent: 429 at P's bound
        with pytest.raises(APIError) as refused:
            sel.pick("prefill", set(), priority=priority)
        assert (refused.value.status, refused.value.stage) == (429, "prefill")
    assert sel.pick("prefill", set(), priority=HIGH) is p  # 8 of 10; tokens not counted
    p.in_flight = 10
    with pytest.raises(APIError):
        sel.pick("prefill", set(), priority=HIGH)  # 10 of 10: the reserve is full too
