"""Overload is refused before work starts, and busy is not down.

An instance's default in-flight bound follows what its engine holds (its --max-num-seqs and
KV cache, from /health or registration); decode's bound is enforced at the door, counting
the requests in prefill, so the decode pick of a request that started never refuses it; a
worker's own 503 `overloaded` gives its breaker no verdict."""

from __future__ import annotations

import httpx
import pytest

from pdrouter.router.instances.instance import Instance
from pdrouter.router.instances.registry import Registry
from pdrouter.router.orchestrator.failures import answer_outcome
from pdrouter.router.selection.admission import Admission, AdmissionConfig
from pdrouter.router.selection.breaker import BreakerBoard, BreakerConfig, BreakerState
from pdrouter.router.selection.policies import RoundRobin
from pdrouter.router.selection.selector import Selector
from pdrouter.wire.errors import APIError
from tests.pdrouter.router.worker_health import worker_health

INFO = worker_health("fp", block_size=16, max_num_seqs=4, num_kv_blocks=64)


def _engine(url: str, role: str = "decode", **kw: int) -> Instance:
    inst = Instance(url, role, block_size=16, max_num_seqs=4, num_kv_blocks=64)  # type: ignore[arg-type]
    for name, value in kw.items():
        setattr(inst, name, value)
    return inst


def test_the_default_bound_is_two_engine_batches_and_two_kv_caches() -> None:
    adm = Admission(AdmissionConfig())
    inst = _engine("http://d", capacity=256)
    assert (adm.engine_bound(inst), adm.bound_of(inst), adm.token_bound(inst)) == (8, 8, 2048)
    assert Admission(AdmissionConfig(max_in_flight_per_instance=5)).bound_of(inst) == 5
    assert Admission(AdmissionConfig(batches_in_flight_per_instance=1.5)).bound_of(inst) == 6
    assert adm.bound_of(_engine("http://d", capacity=3)) == 3
    unknown = Instance("http://d", "decode", capacity=256)  # registered, never checked yet
    assert (adm.bound_of(unknown), adm.token_bound(unknown)) == (256, None)
    assert adm.bound_of(Instance("http://d", "decode")) is None


def test_room_ends_at_either_bound() -> None:
    adm = Admission(AdmissionConfig())
    assert adm.has_room(_engine("http://d", in_flight=7, in_flight_tokens=2047))
    assert not adm.has_room(_engine("http://d", in_flight=8))
    assert not adm.has_room(_engine("http://d", in_flight=1, in_flight_tokens=2048))


def test_a_bad_batches_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="batches_in_flight_per_instance"):
        AdmissionConfig(batches_in_flight_per_instance=0)


def _selector() -> tuple[Selector, Registry]:
    registry = Registry(["http://p"], ["http://d"])
    for inst in registry.all():
        registry.check_passed(inst, INFO)
    policies = {"prefill": RoundRobin(), "decode": RoundRobin()}
    board = BreakerBoard(BreakerConfig())
    return Selector(registry, policies, board, Admission(AdmissionConfig())), registry


def test_the_door_counts_requests_in_prefill_as_decode_calls_to_come() -> None:
    sel, registry = _selector()
    p, d = registry.prefill[0], registry.decode[0]
    d.in_flight, p.in_flight = 5, 2
    sel.ensure_room("decode")  # 7 of 8
    p.in_flight = 3
    with pytest.raises(APIError) as refused:
        sel.ensure_room("decode")
    err = refused.value
    assert (err.status, err.code, err.stage, err.retry_after_s) == (429, "overloaded", "decode", 1)
    assert "8 of 8 calls held (5 on decode instances, 3 in prefill to come; " in err.message
    assert "http://d 5/8 calls 0/2048 tokens" in err.message
    d.in_flight, p.in_flight = 0, 0
    sel.reserve("decode", 1500)  # requests in flight reserved their whole bound
    sel.ensure_room("decode", num_tokens=548)  # 2048 of 2048: it fits
    with pytest.raises(APIError) as refused:
        sel.ensure_room("decode", num_tokens=549)
    err = refused.value
    assert (err.status, err.code, err.stage) == (429, "overloaded", "decode")
    assert err.message.startswith(
        "the decode side is full: requests in flight hold 1500 of its 2048 tokens and this "
        "request may hold 549 "
    )
    sel.release("decode", 1500)
    with pytest.raises(APIError) as never:  # larger than the side ever holds: 400, even idle
        sel.ensure_room("decode", num_tokens=2049)
    err = never.value
    assert (err.status, err.code, err.param) == (400, "request_too_large", "max_tokens")
    assert "may hold 2049 tokens" in err.message and "ever hold: 2048 tokens (1 instances" in (
        err.message
    )
    assert sel.reserved_tokens == {"prefill": 0, "decode": 0}


def test_the_decode_pick_never_refuses_for_load_but_the_prefill_pick_does() -> None:
    sel, registry = _selector()
    p, d = registry.prefill[0], registry.decode[0]
    d.in_flight = p.in_flight = 8  # both at their bound
    assert sel.pick("decode", set()) is d  # a request past the door: its stream may be out
    with pytest.raises(APIError) as refused:
        sel.pick("prefill", set())
    assert (refused.value.status, refused.value.stage) == (429, "prefill")


def test_a_workers_overloaded_503_gives_its_breaker_no_verdict() -> None:
    body = {"error": {"message": "server overloaded: 256 requests in flight",
                      "type": "service_unavailable", "code": "overloaded"}}  # fmt: skip
    full = httpx.Response(503, json=body, headers={"Retry-After": "1"})
    failure = answer_outcome("decode", "http://d", full)
    assert (failure.kind, failure.metric, failure.breaker) == ("unavailable", "overloaded", None)
    assert (failure.marks_down, failure.final) == (False, None)
    sel, _ = _selector()
    for _ in range(3 * sel.breakers.cfg.failure_threshold):
        sel.verdict(_engine("http://d"), failure.breaker)
    assert sel.breakers.state("http://d") is BreakerState.CLOSED
    loading = {"error": {"message": "loading", "type": "service_unavailable", "code": "not_ready"}}
    assert answer_outcome("decode", "http://d", httpx.Response(503, json=loading)).breaker is True


def test_the_decode_pick_still_prefers_an_instance_with_room() -> None:
    registry = Registry(["http://p"], ["http://d0", "http://d1"])
    for inst in registry.all():
        registry.check_passed(inst, INFO)
    board = BreakerBoard(BreakerConfig())
    sel = Selector(registry, {"prefill": RoundRobin(), "decode": RoundRobin()}, board,
                   Admission(AdmissionConfig()))  # fmt: skip
    d0, d1 = registry.decode
    d0.in_flight = 8  # full; round robin alone would pick it every other time
    assert [sel.pick("decode", set()) for _ in range(4)] == [d1] * 4


def test_a_batch_past_what_the_prefill_side_ever_takes_is_a_400() -> None:
    sel, registry = _selector()  # P: 8 calls, 2048 tokens
    sel.ensure_fits("prefill", 8, 2048)  # fits an idle P
    registry.prefill[0].in_flight = 8  # load does not matter: only what can ever fit
    sel.ensure_fits("prefill", 8, 2048)
    with pytest.raises(APIError) as calls:
        sel.ensure_fits("prefill", 9, 10)
    assert (calls.value.status, calls.value.param, calls.value.code) == (
        400, "prompt", "request_too_large")  # fmt: skip
    assert calls.value.message == (
        "this request makes 9 prefill calls at once (one per prompt and sequence), more than "
        "its 1 prefill instances ever take at once (8 calls); send fewer prompts per request"
    )
    with pytest.raises(APIError) as tokens:
        sel.ensure_fits("prefill", 4, 2049)
    assert tokens.value.message.startswith(
        "this request's prompts hold about 2049 tokens at once (estimated), more than its 1 "
        "prefill instances can ever hold: 2048 tokens"
    )
    sel.reserve_of = lambda priority: 2 if priority < 0 else 0
    sel.ensure_fits("prefill", 10, 5000, priority=-1)  # urgent: 2 more calls, tokens lifted
