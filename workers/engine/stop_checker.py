"""StopChecker: turns each sampled token into a text delta and decides when a request ends.

OpenAI/vLLM semantics:
- eos (unless ignore_eos) and stop_token_ids end the request with "stop"; the token counts as
  an output token but adds no text.
- A stop string ends the request with "stop"; the text is cut right before it and the stop
  string itself is never emitted. Text that could still become a stop string is held back:

      emitted so far | pending text           stop = ("</s>",)
      "Hello "       | "wor"      -> emit "wor" (no suffix is a prefix of "</s>")
      "Hello world"  | "</"       -> hold "</" back (it may grow into "</s>")
      "Hello world"  | "</s>"     -> emit "" and finish "stop"

- Before min_tokens outputs, stop strings are not looked for (vLLM: from output min_tokens + 1
  on); the sampler masks the stop tokens until then (workers.engine.penalties).
- max_tokens (counting outputs given at add time) or a sequence of max_model_len tokens ends
  the request with "length"; held-back text is released then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.api import FinishReason


class Detokenizer(Protocol):
    """What the stop checker needs from the tokenizer's incremental detokenizer."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class StopResult:
    text: str
    finish_reason: FinishReason | None


class StopChecker:
    """Per-request stop logic over an incremental detokenizer."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: Sequence[str],
        stop_token_ids: Iterable[int],
        max_tokens: int,
        max_model_len: int,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._max_tokens = max_tokens
        self._max_model_len = max_model_len
        self._min_tokens = min_tokens
        self._max_holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        # The end of the text already emitted (or given at add time): a stop string may start
        # there when prefill released its held-back text before handing over to decode.
        self._emitted_tail = ""

    def prime(self, token_ids: Iterable[int]) -> None:
        """Feed tokens whose text the client already has (outputs given at add time)."""
        for token_id in token_ids:
            self._remember(self._detokenizer.push(token_id))

    def append(self, token_id: int, num_tokens: int, num_output_tokens: int) -> StopResult:
        """Account for one sampled token; num_* are the counts after appending it."""
        if token_id in self._stop_token_ids:
            return StopResult(self._release(), "stop")
        self._pending += self._detokenizer.push(token_id)
        if self._stop and num_output_tokens > self._min_tokens:
            cut_at = self._find_stop()
            if cut_at is not None:
                text = self._pending[:cut_at]
                self._pending = ""
                return StopResult(text, "stop")
        if num_output_tokens >= self._max_tokens or num_tokens >= self._max_model_len:
            return StopResult(self._release(), "length")
        keep = self._holdback_len()
        text = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        self._remember(text)
        return StopResult(text, None)

    def release_held(self) -> str:
        """Emit held-back text without flushing the detokenizer (prefill hands over here:
        an incomplete UTF-8 sequence stays pending for the decode side to complete)."""
        text, self._pending = self._pending, ""
        self._remember(text)
        return text

    def _release(self) -> str:
        text = self._pending + self._detokenizer.flush()
        self._pending = ""
        return text

    def _remember(self, text: str) -> None:
        if self._stop and text:
            self._emitted_tail = (self._emitted_tail + text)[-self._max_holdback_chars :]

    def _find_stop(self) -> int | None:
        """Where in pending to cut for the earliest stop string ending in pending, or None."""
        tail = self._emitted_tail
        text = tail + self._pending
        cuts = []
        for stop in self._stop:
            found_at = text.find(stop, max(len(tail) - len(stop) + 1, 0))
            if found_at >= 0:
                cuts.append(max(found_at - len(tail), 0))
        return min(cuts) if cuts else None

    def _holdback_len(self) -> int:
        """Chars at the end of pending to hold back: the longest suffix of the text so far
        that may still grow into a stop string (its emitted part cannot be held back)."""
        text = self._emitted_tail + self._pending
        for n in range(min(len(text), self._max_holdback_chars), 0, -1):
            if any(s.startswith(text[-n:]) for s in self._stop):
                return min(n, len(self._pending))
        return 0
