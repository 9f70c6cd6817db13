"""pdrouter.wire.sampling_controls through parse_request, and the SamplingParams a worker
builds from them (workers.server.prepare.sampling_params: the one conversion P and D share)."""

from __future__ import annotations

import pytest

from pdrouter.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)
from tests.pdrouter.wire.request_bodies import chat_body, completion_body
from workers.engine.api import SamplingParams
from workers.server.prepare import sampling_params

CONTROLS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -1,
    "repetition_penalty": 1.2,
    "logit_bias": {"50": -100, "7": 2.5, "007": 3},
    "min_p": 0.05,
    "min_tokens": 2,
    "top_k": 40,
    "stop_token_ids": [3, 9],
}


@pytest.mark.parametrize(
    ("request_cls", "body"),
    [(ChatCompletionRequest, chat_body), (CompletionRequest, completion_body)],
)
def test_every_control_reaches_the_sampling_params(request_cls: type, body) -> None:
    parsed = parse_request(request_cls, body(**CONTROLS, max_tokens=8, temperature=0))
    params = sampling_params(parsed, 8)
    assert params == SamplingParams(
        max_tokens=8,
        temperature=0.0,
        top_k=40,
        stop_token_ids=(3, 9),
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        logit_bias=((7, 3.0), (50, -100.0)),  # "007" is token 7, the last spelling wins
        min_tokens=2,
        min_p=0.05,
    )


def test_omitted_and_null_controls_change_nothing() -> None:
    plain = sampling_params(parse_request(ChatCompletionRequest, chat_body()), 4)
    nulls = parse_request(ChatCompletionRequest, chat_body(**dict.fromkeys(CONTROLS)))
    assert sampling_params(nulls, 4) == plain == SamplingParams(max_tokens=4)


@pytest.mark.parametrize(
    ("field", "value", "param", "message"),
    [
        ("presence_penalty", 2.5, "presence_penalty", "less than or equal to 2"),
        ("frequency_penalty", "1", "frequency_penalty", "valid number"),
        ("repetition_penalty", 0, "repetition_penalty", "greater than 0"),
        ("min_p", 1.01, "min_p", "less than or equal to 1"),
        ("min_tokens", -1, "min_tokens", "greater than or equal to 0"),
        ("logit_bias", {"x": 1}, "logit_bias.x", "should match pattern"),
        ("logit_bias", {"-1": 1}, "logit_bias", "should match pattern"),
        ("logit_bias", {"5": 100.5}, "logit_bias", "less than or equal to 100"),
        ("logit_bias", [1], "logit_bias", "should be an object"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(field, value, param, message) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(ChatCompletionRequest, chat_body(**{field: value}))
    assert info.value.param == param
    assert message in info.value.message


def test_min_tokens_over_max_tokens_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(CompletionRequest, completion_body(min_tokens=5, max_tokens=4))
    assert (info.value.param, info.value.message) == (
        "min_tokens",
        "min_tokens (5) must not exceed max_tokens (4)",
    )
    chat = chat_body(min_tokens=5, max_tokens=2, max_completion_tokens=6)  # the newer name wins
    assert parse_request(ChatCompletionRequest, chat).min_tokens == 5
