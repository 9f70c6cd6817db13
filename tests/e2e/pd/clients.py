"""Helpers the PD tests share: run one request through the official openai client and reduce
the answer to (text, finish_reason, prompt_tokens, completion_tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import openai

# Printable ASCII byte tokens of the tiny byte-level tokenizer (ids 0..255 are bytes).
_FIRST_ID, _NUM_IDS = 33, 90


def prompt_ids(num_tokens: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly num_tokens token ids. Prompts of one salt are prefixes of
    each other; prompts of different salts differ from their first tokens on (seeded draws: an
    arithmetic formula repeats across salts, and a shared first block makes one test's keys
    another's pool hits)."""
    rng = random.Random(salt)
    return [_FIRST_ID + rng.randrange(_NUM_IDS) for _ in range(num_tokens)]


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def complete(api: openai.OpenAI, stream: bool, **kwargs: Any) -> Answer:
    """A completion, streamed (with include_usage) or not."""
    if not stream:
        r = api.completions.create(**kwargs)
        u = r.usage
        return Answer(r.choices[0].text, r.choices[0].finish_reason, u.prompt_tokens,
                      u.completion_tokens)  # fmt: skip
    texts, finish, usage = [], None, None
    for chunk in api.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        for choice in chunk.choices:
            texts.append(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert usage is not None, "no usage chunk"
    return Answer("".join(texts), finish, usage.prompt_tokens, usage.completion_tokens)


def chat(api: openai.OpenAI, stream: bool, **kwargs: Any) -> Answer:
    """A chat completion, streamed (with include_usage) or not."""
    if not stream:
        r = api.chat.completions.create(**kwargs)
        u = r.usage
        return Answer(r.choices[0].message.content or "", r.choices[0].finish_reason,
                      u.prompt_tokens, u.completion_tokens)  # fmt: skip
    texts, finish, usage, roles = [], None, None, []
    for chunk in api.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert roles == ["assistant"], f"the role must come once, in the first chunk: {roles}"
    assert usage is not None, "no usage chunk"
    return Answer("".join(texts), finish, usage.prompt_tokens, usage.completion_tokens)
