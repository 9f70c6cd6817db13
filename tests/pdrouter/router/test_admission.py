"""Admission: global and per-instance in-flight limits, exact counts, 429 shapes."""

from __future__ import annotations

from typing import Any

import pytest

from pdrouter.router.instances.instance import Instance
from pdrouter.router.selection.admission import (
    Admission,
    AdmissionConfig,
    estimate_prompt_tokens,
    max_output_tokens,
)
from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest


def test_global_limit_admits_exactly_n_then_429_with_retry_after() -> None:
    adm = Admission(AdmissionConfig(max_in_flight=2, retry_after_s=3))
    adm.enter()
    adm.enter()
    with pytest.raises(APIError) as info:
        adm.enter()
    err = info.value
    assert (err.status, err.code, err.err_type) == (429, "overloaded", "rate_limit_error")
    assert err.headers() == {"Retry-After": "3"}
    assert err.message == (
        "router overloaded: 2 requests in flight (--max-in-flight 2); retry later"
    )
    assert (adm.num_in_flight, adm.num_rejected) == (2, 1)
    adm.leave()
    adm.enter()  # room again once one is answered
    assert adm.num_in_flight == 2


def test_no_limit_admits_everything() -> None:
    adm = Admission(AdmissionConfig())
    for _ in range(1000):
        adm.enter()
    assert (adm.num_in_flight, adm.num_rejected) == (1000, 0)


def test_leave_without_enter_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="without a matching enter"):
        Admission(AdmissionConfig()).leave()


def test_per_instance_room_and_its_429() -> None:
    adm = Admission(AdmissionConfig(max_in_flight_per_instance=2))
    inst, other = Instance("http://127.0.0.1:9000", "decode"), Instance("http://b:1", "decode")
    assert adm.with_room([inst, other]) == [inst, other]
    inst.in_flight = 2
    assert adm.with_room([inst, other]) == [other]
    assert adm.with_room([inst]) == []
    assert Admission(AdmissionConfig()).with_room([inst, other]) == [inst, other]
    err = adm.instances_full("decode", [inst])
    assert (err.status, err.stage, err.retry_after_s) == (429, "decode", 1)
    assert "every decode instance is at its in-flight limit" in err.message
    assert "http://127.0.0.1:9000" in err.message
    assert adm.num_rejected == 1


def test_registered_capacity_bounds_an_instance_without_the_flag() -> None:
    adm = Admission(AdmissionConfig())
    full, free, unbounded = (
        Instance("http://a:1", "decode", capacity=2),
        Instance("http://b:1", "decode", capacity=3),
        Instance("http://c:1", "decode"),
    )
    full.in_flight, free.in_flight, unbounded.in_flight = 2, 2, 10_000
    assert [adm.bound_of(i) for i in (full, free, unbounded)] == [2, 3, None]
    assert adm.with_room([full, free, unbounded]) == [free, unbounded]
    free.in_flight = 3
    assert adm.with_room([full, free]) == []
    err = adm.instances_full("decode", [full, free])
    assert (err.status, err.code, err.retry_after_s) == (429, "overloaded", 1)
    assert err.message == (
        "every decode instance is at its in-flight limit (http://a:1 2/2 calls, "
        "http://b:1 3/3 calls; the call limit is the smallest of its registered capacity, its "
        "engine's batches (--batches-in-flight-per-instance) and --max-in-flight-per-instance, "
        "the token limit as many batches of its KV cache); retry later"
    )


def test_the_smaller_of_capacity_and_the_flag_is_the_bound() -> None:
    adm = Admission(AdmissionConfig(max_in_flight_per_instance=4))
    small, large, unregistered = (
        Instance("http://a:1", "prefill", capacity=2),
        Instance("http://b:1", "prefill", capacity=64),
        Instance("http://c:1", "prefill"),
    )
    assert [adm.bound_of(i) for i in (small, large, unregistered)] == [2, 4, 4]
    small.in_flight, large.in_flight, unregistered.in_flight = 2, 3, 4
    assert adm.with_room([small, large, unregistered]) == [large]


@pytest.mark.parametrize("field", ["max_in_flight", "max_in_flight_per_instance"])
def test_config_refuses_zero(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        AdmissionConfig(**{field: 0})


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", **fields})


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


def test_token_estimates() -> None:
    assert estimate_prompt_tokens(_completion(prompt="x" * 40)) == 11
    assert estimate_prompt_tokens(_completion(prompt=[1, 2, 3])) == 4
    assert estimate_prompt_tokens(_completion(prompt=["x" * 8])) == 3
    parts = [{"type": "text", "text": "zz"}, {"type": "text", "text": "z"}]
    chat = _chat(
        messages=[{"role": "user", "content": "y" * 8}, {"role": "user", "content": parts}]
    )
    assert estimate_prompt_tokens(chat) == 4  # 8 + "zz\nz"
    assert max_output_tokens(_completion(prompt="p", max_tokens=32), 512, 2) == 32
    messages = [{"role": "user", "content": "q"}]
    chat = _chat(messages=messages, max_completion_tokens=8, max_tokens=32)
    assert max_output_tokens(chat, 512, 2) == 8
    # unset: completions' default 16; chat's what the context leaves (none known: 0)
    assert max_output_tokens(_completion(prompt="p"), 512, 2) == 16
    assert max_output_tokens(_chat(messages=messages), 512, 2) == 510
    assert max_output_tokens(_chat(messages=messages), None, 2) == 0
    assert max_output_tokens(_completion(prompt="p", max_tokens=0), 512, 2) == 1  # scoring


def test_serve_flags_reach_the_router_config() -> None:
    import argparse

    from pdrouter.router import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--prefill-policy", "power_of_two", "--decode-policy", "least_loaded",
            "--max-in-flight", "64", "--max-in-flight-per-instance", "8",
            "--breaker-failures", "3", "--breaker-cooldown-s", "2.5",
            "--timeline-capacity", "16"]  # fmt: skip
    cfg = serve.config_from_args(parser.parse_args(argv))
    assert (cfg.prefill_policy, cfg.decode_policy) == ("power_of_two", "least_loaded")
    assert (cfg.admission.max_in_flight, cfg.admission.max_in_flight_per_instance) == (64, 8)
    assert (cfg.breaker.failure_threshold, cfg.breaker.cooldown_s) == (3, 2.5)
    assert cfg.timeline_capacity == 16
    defaults = serve.config_from_args(parser.parse_args(argv[:4]))
    assert (defaults.admission.max_in_flight, defaults.admission.max_in_flight_per_instance) == (
        None, None
    )  # fmt: skip
    assert (defaults.prefill_policy, defaults.breaker.failure_threshold) == ("round_robin", 5)
