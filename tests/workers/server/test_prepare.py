"""workers.server.prepare: templating, tokenizing and sizing, on the real tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from workers.engine.api import SamplingParams
from workers.engine.tiny import materialize_tiny
from workers.engine.tokenizer import Tokenizer
from workers.server.prepare import check_model_name, fit_max_tokens, prepare_request

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = materialize_tiny("tiny", 0, tmp_path_factory.mktemp("tiny-cache"))
    return Tokenizer.from_dir(Path(folder))


def _parse(cls: type, **body: object) -> ChatCompletionRequest | CompletionRequest:
    return parse_request(cls, json.dumps({"model": "tiny", **body}).encode())


def test_completion_text_prompt(tokenizer: Tokenizer) -> None:
    req = _parse(
        CompletionRequest,
        prompt="hello",
        max_tokens=5,
        temperature=0,
        seed=3,
        stop=["a", "b"],
        stop_token_ids=[1],
        top_k=-1,
    )
    prepared = prepare_request(req, "r1", tokenizer, MAX_MODEL_LEN)
    assert prepared.request_id == "r1"
    assert prepared.kind == "completion"
    assert prepared.prompt_token_ids == tuple(tokenizer.encode("hello", add_special_tokens=True))
    assert prepared.params == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=3,
        stop=("a", "b"),
        stop_token_ids=(1,),
        ignore_eos=False,
    )
    assert (prepared.stream, prepared.include_usage) == (False, False)


def test_completion_token_prompt_is_taken_as_is(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt=[[10, 11, 12]], max_tokens=2)
    prepared = prepare_request(req, "r2", tokenizer, MAX_MODEL_LEN)
    assert prepared.prompt_token_ids == (10, 11, 12)


def test_chat_prompt_is_the_templated_text(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    req = _parse(
        ChatCompletionRequest,
        messages=messages,
        max_completion_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    prepared = prepare_request(req, "r3", tokenizer, MAX_MODEL_LEN)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prepared.prompt_token_ids == tuple(tokenizer.encode(text, add_special_tokens=False))
    assert prepared.kind == "chat"
    assert prepared.params.max_tokens == 3
    assert prepared.params.temperature == 1.0
    assert (prepared.stream, prepared.include_usage) == (True, True)


def test_default_max_tokens_is_16_within_the_context(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt=[1, 2, 3, 4])
    assert prepare_request(req, "r4", tokenizer, MAX_MODEL_LEN).params.max_tokens == 16
    near_full = _parse(CompletionRequest, prompt=[1] * (MAX_MODEL_LEN - 5))
    assert prepare_request(near_full, "r5", tokenizer, MAX_MODEL_LEN).params.max_tokens == 5
    chat = _parse(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}])
    assert prepare_request(chat, "r6", tokenizer, MAX_MODEL_LEN).params.max_tokens > 16


def test_echo_asks_prompt_logprobs_and_max_tokens_0_runs_one(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt=[1, 2, 3], echo=True, logprobs=2, max_tokens=0)
    prepared = prepare_request(req, "r7", tokenizer, MAX_MODEL_LEN)
    assert (prepared.params.prompt_logprobs, prepared.params.max_tokens) == (2, 1)
    assert prepared.score_only and prepared.echo_text == tokenizer.decode([1, 2, 3], False)
    plain = prepare_request(_parse(CompletionRequest, prompt="ab", logprobs=2), "r8", tokenizer,
                            MAX_MODEL_LEN)  # fmt: skip
    assert plain.params.prompt_logprobs is None and not plain.scoring


def _refusal(fn: object, *args: object) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)  # type: ignore[operator]
    assert info.value.status == 400
    return info.value


def test_context_checks() -> None:
    assert fit_max_tokens(10, 54, 64, "prompt") == 54
    empty = _refusal(fit_max_tokens, 0, 5, 64, "prompt")
    assert (empty.param, empty.message) == (
        "prompt",
        "the prompt is empty (it encodes to zero tokens)",
    )
    too_long = _refusal(fit_max_tokens, 64, None, 64, "messages")
    assert (too_long.param, too_long.code) == ("messages", "context_length_exceeded")
    assert "maximum context length is 64 tokens, but the prompt has 64 tokens" in too_long.message
    over = _refusal(fit_max_tokens, 10, 55, 64, "prompt", "max_completion_tokens")
    assert (over.param, over.code) == ("max_completion_tokens", "context_length_exceeded")
    assert "you requested 65 tokens (10 in the prompt, 55 for the completion)" in over.message


def test_out_of_vocab_prompt_ids(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt=[1, tokenizer.vocab_size, -1])
    err = _refusal(prepare_request, req, "r5", tokenizer, MAX_MODEL_LEN)
    assert err.param == "prompt"
    assert f"[0, {tokenizer.vocab_size}); got [{tokenizer.vocab_size}, -1]" in err.message


def test_empty_text_prompt(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt="")
    assert _refusal(prepare_request, req, "r6", tokenizer, MAX_MODEL_LEN).param == "prompt"


def test_unknown_model_name() -> None:
    check_model_name("tiny", ("tiny", "alias"))
    err = _refusal(check_model_name, "gpt-4", ("tiny",))
    assert (err.param, err.code) == ("model", "model_not_found")


def test_a_negative_seed_is_its_twos_complement(tokenizer: Tokenizer) -> None:
    req = _parse(CompletionRequest, prompt=[1, 2], seed=-2)
    assert prepare_request(req, "r9", tokenizer, MAX_MODEL_LEN).params.seed == 2**64 - 2
    unseeded = _parse(CompletionRequest, prompt=[1, 2], seed=-1)
    assert prepare_request(unseeded, "r10", tokenizer, MAX_MODEL_LEN).params.seed is None
