"""The engine's SampledLogprobs as wire TokenLogprobs: token ids become their strings here,
on the worker that sampled them (the router has no tokenizer).

A token's string is its own decoding, special tokens included (an end-of-sequence token has
a logprob too); a token that is only part of a multi-byte character decodes to U+FFFD, and its
`bytes` are those of that string, as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdrouter.wire.logprobs import TokenLogprob, TopLogprob
from pdrouter.wire.scoring import EchoedPrompt
from workers.engine.api import SampledLogprobs


def _token(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def wire_logprobs(tokenizer: Any, entries: Sequence[SampledLogprobs]) -> list[TokenLogprob]:
    """One TokenLogprob per engine entry, in order."""
    wire = []
    for entry in entries:
        sampled = _token(tokenizer, entry.token_id, entry.logprob)
        top = [_token(tokenizer, token_id, logprob) for token_id, logprob in entry.top]
        wire.append(TokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return wire


def echoed_prompt(
    tokenizer: Any,
    echo_text: str,
    prompt_token_ids: Sequence[int],
    entries: Sequence[SampledLogprobs] | None,
) -> EchoedPrompt:
    """The prompt as completions' echo gives it (pdrouter.wire.scoring): its text and, with
    the engine's prompt logprobs (entries), its first token's string and every later token's
    entry."""
    if entries is None:
        return EchoedPrompt(text=echo_text)
    first = tokenizer.decode([prompt_token_ids[0]], skip_special_tokens=False)
    return EchoedPrompt(
        text=echo_text, first_token=first, logprobs=wire_logprobs(tokenizer, entries)
    )
