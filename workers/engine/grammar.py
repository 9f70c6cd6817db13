"""Grammar-constrained decoding through llguidance: compile, mask the logits, advance.

    server    compile_json_schema(schema_json)  -> grammar (str), cached by schema; a schema
                                                   llguidance cannot compile: GrammarError
              SamplingParams.grammar = grammar     (P and D build the same from one body)
    worker    Grammars(tokenizer, vocab_size).view()  the tokenizer's llguidance view
              start                                (40-170 ms), once, on the loader thread
    server    Grammars.ready(request)               request with its matcher: a fresh one
    (admission,                                    that has consumed the tokens the request
     CPU threads)                                  already has (D: P's first token and any
                                                   streamed before a failover), ~0.6 ms
    engine    add_request takes request.matcher    (refused without one: the engine thread
                                                   never builds a view or a matcher)
              step: mask_logits(logits, matchers)  rows with a matcher: tokens the grammar
                                                   forbids at -inf (one bitmask for the batch)
                    advance(matchers, sampled)     each matcher consumes its row's token

Why llguidance (docs/benchmarks/structured.md): a manylinux wheel with no dependencies (xgrammar
needs torch, transformers and triton), no ahead-of-time index (outlines-core builds a regex
index per schema: milliseconds for a small one, growing with the schema), and a mask in
~50 us per token here. The JSON it allows is compact (no free whitespace), so a small model
cannot loop on blanks; once the grammar is complete only an end-of-sequence token is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from workers.engine.api import EngineRequest

# Compact JSON: no whitespace between tokens (a small model could emit blanks forever).
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema the grammar library cannot compile; the message says why."""


@functools.lru_cache(maxsize=512)
def compile_json_schema(schema_json: str) -> str:
    """The llguidance grammar of a JSON schema (canonical JSON text), checked to compile."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults=_JSON_OPTIONS)
    except (ValueError, RuntimeError) as exc:  # not a schema it can read
        raise GrammarError(str(exc)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0])
    return grammar


class GrammarMatcher:
    """One request's grammar state: which tokens may come next."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, bitmask_row: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask_row[np.newaxis], 0)

    def advance(self, token_id: int) -> None:
        """Consume a sampled token. A token past the grammar's end (an end-of-sequence token
        the request ignores) leaves the matcher stopped: its mask then allows only ends."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    @property
    def raw(self) -> Any:
        """The llguidance matcher (for the batched mask)."""
        return self._matcher

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class Grammars:
    """Matchers over one tokenizer. Its llguidance view is built once, by whichever thread asks
    first (a worker asks at start, on its loader thread); matchers are built by the servers'
    CPU threads at admission (ready()). Both are thread-safe to build and share."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._view: Any = None

    def view(self) -> Any:
        """The tokenizer's llguidance view, built on the first call (the others wait for it)."""
        with self._lock:
            if self._view is None:
                import llguidance

                self._view = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids),
                )
            return self._view

    def warm(self) -> None:
        """Build the view now (a worker at start), if the tokenizer has a `tokenizers`
        definition to build it from (a test's character tokenizer has none: free text only)."""
        if hasattr(self._tokenizer, "backend_json"):
            self.view()

    def matcher(self, grammar: str, replay_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for grammar that has consumed replay_token_ids (the request's outputs so
        far); ValueError if they do not follow the grammar."""
        import llguidance

        matcher = llguidance.LLMatcher(self.view(), grammar, log_level=0)
        if replay_token_ids and not matcher.consume_tokens(list(replay_token_ids)):
            raise ValueError(
                f"the output tokens given do not follow the request's grammar: "
                f"{matcher.get_error()}"
            )
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher)

    def ready(self, request: EngineRequest) -> EngineRequest:
        """request with the matcher the engine needs (EngineRequest.matcher), built here; the
        request itself when it is free text or already has one. Off the engine thread."""
        grammar = request.params.grammar
        if grammar is None or request.matcher is not None:
            return request
        others = request.later_sequence_outputs
        return dataclasses.replace(
            request,
            matcher=self.matcher(grammar, request.output_token_ids),
            sequence_matchers=tuple(self.matcher(grammar, tokens) for tokens in others),
        )


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor()


def mask_logits(logits: np.ndarray, matchers: Sequence[GrammarMatcher | None]) -> np.ndarray:
    """logits with each constrained row's forbidden tokens at -inf (a copy; the raw logits
    stay for logprobs); logits itself when no row is constrained."""
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    bitmask = np.zeros((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    constrained = [m for m in matchers if m is not None]
    if len(constrained) == 1:
        constrained[0].fill(bitmask[0])
    else:  # llguidance's thread pool computes the rows' masks in parallel
        from llguidance.numpy import fill_next_token_bitmask_par

        pairs = [(m.raw, i) for i, m in enumerate(constrained)]
        fill_next_token_bitmask_par(_executor(), pairs, bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    masked = logits.copy()
    masked[rows] = np.where(allowed.astype(bool), logits[rows], -np.inf)
    return masked


def advance(matchers: Sequence[GrammarMatcher | None], token_ids: Sequence[int]) -> None:
    for matcher, token_id in zip(matchers, token_ids, strict=True):
        if matcher is not None:
            matcher.advance(token_id)
