"""Grammar-constrained decoding through llguidance: compile, mask the logits, advance.

    server    Grammars.compile(schema_json)      -> grammar (str): a child process within a
              (a thread awaited)                    size and time budget, cached by schema
                                                    (grammar_compiler.py); past a budget
                                                    GrammarBudgetError, a schema llguidance
                                                    cannot compile GrammarError
              SamplingParams.grammar = grammar     (P and D build the same from one body)
    worker    Grammars(tokenizer, vocab_size).view()  the tokenizer's llguidance view
              start                                (40-170 ms), once, on the loader thread
    server    Grammars.ready(request)               request with its matcher: a copy of the
    (admission,                                    schema's first matcher (built once per
     CPU threads)                                  grammar, by compile), advanced over the
                                                   tokens the request already has (D: P's
                                                   first token and any streamed before a
                                                   failover)
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
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from workers.engine.api import EngineRequest
from workers.engine.grammar_child import compile_schema
from workers.engine.grammar_compiler import (
    DEFAULT_BUDGET,
    GrammarBudget,
    GrammarCompiler,
    GrammarCounts,
    GrammarError,
    TokenizerSpec,
)

# First matchers kept per grammar (each request gets a copy): a matcher over a large schema
# costs what its compile did; a copy costs microseconds.
_NUM_TEMPLATES = 64

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=512)
def compile_json_schema(schema_json: str) -> str:
    """The llguidance grammar of a JSON schema, compiled in this process with no budget and
    no tokenizer (tests and benchmarks; servers use Grammars.compile)."""
    try:
        return compile_schema(schema_json, None)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


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

    def __init__(
        self, tokenizer: Any, vocab_size: int, budget: GrammarBudget = DEFAULT_BUDGET
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._view: Any = None
        self._view_error: str | None = None  # llguidance could not read the tokenizer
        self._templates: OrderedDict[str, Any] = OrderedDict()
        tokenizer_json = tokenizer.backend_json() if hasattr(tokenizer, "backend_json") else None
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()))
        self._compiler = GrammarCompiler(TokenizerSpec(tokenizer_json, vocab_size, eos), budget)

    def compile(self, schema_json: str) -> str:
        """The grammar of schema_json within the budget (GrammarCompiler.compile), and its
        first matcher built here too (about what the child's compile cost), so admission
        (ready(), on the few CPU-work threads) only copies it. Blocks: call it from a thread."""
        if hasattr(self._tokenizer, "backend_json"):
            self.view()  # a tokenizer llguidance cannot read: its reason, not a child's crash
        grammar = self._compiler.compile(schema_json)
        if hasattr(self._tokenizer, "backend_json"):  # a view to build matchers over
            self._template(grammar)
        return grammar

    def cached(self, schema_json: str) -> str | None:
        """The grammar of a schema compiled before, without waiting (GrammarCompiler.cached)."""
        return self._compiler.cached(schema_json)

    def counts(self) -> GrammarCounts:
        return self._compiler.counts()

    def close(self) -> None:
        self._compiler.close()

    def view(self) -> Any:
        """The tokenizer's llguidance view, built on the first call (the others wait for it)."""
        with self._lock:
            if self._view is None and self._view_error is None:
                import llguidance

                try:
                    self._view = llguidance.LLTokenizer(
                        self._tokenizer.backend_json(),
                        n_vocab=self.vocab_size,
                        eos_token=list(self._tokenizer.eos_token_ids),
                    )
                except ValueError as exc:  # a decoder llguidance does not know, say
                    self._view_error = (
                        "structured output is unavailable with this model's tokenizer "
                        f"(llguidance cannot read it: {exc})"
                    )
            if self._view_error is not None:
                raise GrammarError(self._view_error)
            return self._view

    def warm(self) -> None:
        """Build the view now (a worker at start), if the tokenizer has a `tokenizers`
        definition to build it from (a test's character tokenizer has none: free text only).
        A tokenizer llguidance cannot read leaves the worker serving free text: it says so
        here, and each constrained request gets a 400 naming the reason."""
        if hasattr(self._tokenizer, "backend_json"):
            try:
                self.view()
            except ValueError as exc:
                log.warning("%s; constrained requests will be refused", exc)

    def matcher(self, grammar: str, replay_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for grammar that has consumed replay_token_ids (the request's outputs so
        far); ValueError if they do not follow the grammar."""
        matcher = self._template(grammar).deep_copy()
        if replay_token_ids and not matcher.consume_tokens(list(replay_token_ids)):
            raise ValueError(
                f"the output tokens given do not follow the request's grammar: "
                f"{matcher.get_error()}"
            )
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher)

    def _template(self, grammar: str) -> Any:
        """The grammar's first matcher, built once (two threads may both build a new one;
        either copy is the same)."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                return template
        import llguidance

        template = llguidance.LLMatcher(self.view(), grammar, log_level=0)
        with self._lock:
            self._templates[grammar] = template
            while len(self._templates) > _NUM_TEMPLATES:
                self._templates.popitem(last=False)
        return template

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
