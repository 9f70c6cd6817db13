"""Prompt scoring on completions: `echo` (the prompt before the completion, with its tokens'
logprobs when `logprobs` is set) and `max_tokens: 0` (vLLM's pure scoring: nothing generated).

Whoever computed the prompt (the mixed worker, or P through PD) gives an `EchoedPrompt`: the
prompt as text and, when logprobs were asked, each prompt token's entry under the model given
the tokens before it (none for the first, which OpenAI reports as null). `Scoring` then
rewrites one sequence's answer, whole or chunk by chunk, the same way on both paths:

    text          echoed prompt + completion    (score only: the prompt alone)
    logprobs      tokens [p0, p1, ..., g0, ...], token_logprobs [null, lp(p1), ..., lp(g0)],
                  top_logprobs [null, {...}, ...], text_offset over the whole text
    usage         score only: completion_tokens 0 (the engine samples one token it drops)

A score-only request runs with max_tokens 1 in the engine (its last prompt position's
logits come with the prompt's): that token is dropped here, and its finish reason is
"length".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pdrouter.wire.logprobs import TokenLogprob, completion_logprobs, text_length


class EchoedPrompt(BaseModel):
    """The prompt as a completions answer echoes it."""

    text: str
    # With logprobs: the first token's string, and one entry per later prompt token.
    first_token: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def logprobs_shape(self) -> dict[str, Any] | None:
        """The prompt's part of completions' logprobs (text offsets from 0)."""
        if self.logprobs is None or self.first_token is None:
            return None
        rest = completion_logprobs(self.logprobs, len(self.first_token)).model_dump()
        return {
            "tokens": [self.first_token, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    @property
    def logprobs_length(self) -> int:
        """How far the prompt's tokens move the completion's text offsets."""
        if self.logprobs is None or self.first_token is None:
            return 0
        return len(self.first_token) + text_length(self.logprobs)


def _joined(head: dict[str, Any] | None, tail: dict[str, Any] | None, shift: int) -> Any:
    """Two completions logprobs shapes one after the other (tail's offsets moved by shift)."""
    if head is None:
        return tail
    if tail is None:
        return head
    return {
        "tokens": head["tokens"] + tail["tokens"],
        "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
        "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
        "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]],
    }


_NO_LOGPROBS = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


@dataclass
class Scoring:
    """One sequence's answer with its prompt echoed and/or its sampled token dropped."""

    echoed: EchoedPrompt | None  # None: no echo
    score_only: bool  # max_tokens 0
    _started: bool = field(default=False, init=False)

    def _choice(self, choice: dict[str, Any], first: bool) -> None:
        lp = choice.get("logprobs")
        if self.score_only:
            choice["text"] = ""
            if lp is not None:
                lp = dict(_NO_LOGPROBS)
            if choice.get("finish_reason") is not None:
                choice["finish_reason"] = "length"
        if first and self.echoed is not None:
            choice["text"] = self.echoed.text + choice["text"]
            head = self.echoed.logprobs_shape()
            lp = _joined(head, lp, self.echoed.logprobs_length) if lp is not None else None
        elif lp is not None and self.echoed is not None:
            shift = self.echoed.logprobs_length
            lp = {**lp, "text_offset": [o + shift for o in lp["text_offset"]]}
        if lp is not None:
            choice["logprobs"] = lp

    def _usage(self, usage: dict[str, Any] | None) -> None:
        if usage is not None and self.score_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]

    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole completions answer of one sequence, rewritten in place."""
        self._choice(body["choices"][0], first=True)
        self._usage(body.get("usage"))
        return body

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """One completions stream chunk of one sequence, rewritten in place (its first chunk
        carries the echo)."""
        if event.get("choices"):
            self._choice(event["choices"][0], first=not self._started)
            self._started = True
        self._usage(event.get("usage"))
        return event


def scored(scoring: Scoring | None, data: bytes) -> bytes:
    """SSE bytes of one sequence's stream with scoring's rewrite (none: as they are)."""
    if scoring is None:
        return data
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: {"):
            event = scoring.event(json.loads(block[6:]))
            block = b"data: " + json.dumps(event, separators=(",", ":")).encode()
        if block:
            out.append(block + b"\n\n")
    return b"".join(out)
