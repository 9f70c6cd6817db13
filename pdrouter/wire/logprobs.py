"""Log probabilities on the wire: what P and D send the router, and the two OpenAI shapes.

Every hop carries one `TokenLogprob` per generated token (the chat shape: the sampled token's
string, its log probability under the model's distribution (the log-softmax of the raw logits,
before temperature, top-k or top-p, as vLLM reports by default), its UTF-8 bytes and the k
most likely tokens); the worker that sampled the token builds it, since only it has the
tokenizer. The router only concatenates and reshapes:

    chat         choice.logprobs = {"content": [TokenLogprob, ...]}
    completions  choice.logprobs = {"tokens": [...], "token_logprobs": [...],
                                    "top_logprobs": [{token: logprob} (top k + the sampled)],
                                    "text_offset": [offset of each token in the text]}

The request side: chat `logprobs: true` + `top_logprobs: k`, completions `logprobs: k`; k is at
most MAX_TOP_LOGPROBS (OpenAI's limit for chat; vLLM's default for both).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

MAX_TOP_LOGPROBS = 20


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """One generated token: itself and the top_logprobs most likely tokens at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def text_length(entries: Sequence[TokenLogprob]) -> int:
    """How far entries move the completions text_offset (the length of their token strings)."""
    return sum(len(e.token) for e in entries)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=list(entries))


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """The completions shape of entries whose first token starts at text offset `offset`."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    tops: list[dict[str, float] | None] = []
    for entry in entries:
        top = {t.token: t.logprob for t in entry.top_logprobs}
        top.setdefault(entry.token, entry.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=tops,
        text_offset=offsets,
    )
