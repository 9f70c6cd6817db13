"""A mixed worker's logprobs: one entry per generated token, streamed the same as whole, the
completions text_offset running across chunks, the strings the tokenizer gives."""

from __future__ import annotations

import openai
import pytest

from tests.workers.server.conftest import WorkerHandle
from workers.engine.tokenizer import Tokenizer


@pytest.fixture
def client(worker: WorkerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=120)


def test_completion_logprobs_streamed_equal_whole(
    client: openai.OpenAI, tiny_tokenizer: Tokenizer
) -> None:
    kwargs = {"model": "tiny", "prompt": "logprobs please", "max_tokens": 6, "temperature": 0.7,
              "seed": 5, "logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kwargs)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) in (2, 3) and tok in top
               for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))  # fmt: skip
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            part = chunk.choices[0].logprobs
            tokens += part.tokens
            logprobs += part.token_logprobs
            offsets += part.text_offset
    assert (tokens, logprobs, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_chat_logprobs_strings_are_the_tokenizers(
    client: openai.OpenAI, tiny_tokenizer: Tokenizer
) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = answer.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        (top,) = entry.top_logprobs
        assert (top.token, top.logprob) == (entry.token, entry.logprob)  # greedy: the argmax
        assert entry.bytes == list(entry.token.encode())
        token_id = tiny_tokenizer.encode(entry.token)
        assert tiny_tokenizer.decode(token_id, skip_special_tokens=False) == entry.token
    # asked for none: null
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None
