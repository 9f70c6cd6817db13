"""pdrouter.wire.unsupported through parse_request: parameters this server does not implement
are refused with a 400 naming them, values that change nothing pass, and JSON null is
"omitted" for every optional field."""

from __future__ import annotations

import pytest

from pdrouter.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)
from pdrouter.wire.unsupported import UNSUPPORTED_NOOP_VALUES
from tests.pdrouter.wire.request_bodies import chat_body, completion_body

CHAT_REFUSED = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
]


@pytest.mark.parametrize(("param", "value"), CHAT_REFUSED)
def test_chat_refuses_what_it_would_ignore(param: str, value: object) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(ChatCompletionRequest, chat_body(**{param: value}))
    assert info.value.param == param
    assert info.value.message.startswith(f"{param} is not supported by this server")


@pytest.mark.parametrize(
    ("param", "value"),
    [("suffix", "tail")],
)  # fmt: skip
def test_completions_refuse_what_they_would_ignore(param: str, value: object) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(CompletionRequest, completion_body(**{param: value}))
    assert info.value.param == param


@pytest.mark.parametrize("param", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [5, -2.5, 2.0001])
def test_penalties_out_of_openai_range_are_named_as_such(param: str, value: float) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(ChatCompletionRequest, chat_body(**{param: value}))
    assert info.value.param == param
    bound = "less than or equal to 2" if value > 0 else "greater than or equal to -2"
    assert info.value.message == f"{param}: Input should be {bound}"


def test_a_penalty_must_be_a_number() -> None:
    for value in (True, "0", [0]):
        with pytest.raises(ProtocolError) as info:
            parse_request(CompletionRequest, completion_body(presence_penalty=value))
        assert info.value.param == "presence_penalty"
        assert "valid number" in info.value.message


def test_values_that_change_nothing_are_accepted() -> None:
    chat_only = {"functions", "function_call"}
    for param, noops in UNSUPPORTED_NOOP_VALUES.items():
        for value in noops:
            if param != "suffix":
                parse_request(ChatCompletionRequest, chat_body(**{param: value}))
            if param not in chat_only:
                parse_request(CompletionRequest, completion_body(**{param: value}))
    # 0.0 is the same no-op as 0
    parse_request(ChatCompletionRequest, chat_body(presence_penalty=0.0, frequency_penalty=0.0))


def test_a_boolean_is_not_a_numeric_noop() -> None:
    # False == 0 in Python; as a penalty it is a wrong type, not the no-op 0.
    with pytest.raises(ProtocolError):
        parse_request(ChatCompletionRequest, chat_body(frequency_penalty=False))


def test_null_means_omitted_for_every_optional_field() -> None:
    chat_fields = set(ChatCompletionRequest.model_fields) - {"model", "messages"}
    req = parse_request(ChatCompletionRequest, chat_body(**dict.fromkeys(chat_fields)))
    assert req == parse_request(ChatCompletionRequest, chat_body())
    assert (req.n, req.stream, req.logprobs) == (1, False, False)
    completion_fields = set(CompletionRequest.model_fields) - {"model", "prompt"}
    req = parse_request(CompletionRequest, completion_body(**dict.fromkeys(completion_fields)))
    assert req == parse_request(CompletionRequest, completion_body())
    assert (req.n, req.stream, req.echo) == (1, False, False)
    message = {"role": "user", "content": None, "name": None}
    chat = parse_request(ChatCompletionRequest, chat_body(messages=[message]))
    assert chat.messages[0].content is None


def test_null_required_field_is_reported_missing() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(CompletionRequest, completion_body(model=None))
    assert (info.value.param, info.value.message) == ("model", "model: Field required")
    with pytest.raises(ProtocolError) as info:
        parse_request(ChatCompletionRequest, chat_body(messages=[{"role": None, "content": "x"}]))
    assert info.value.param == "messages[0].role"
