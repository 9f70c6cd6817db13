"""The grammar compiler's child process: compiles JSON schemas with llguidance, one at a time.

    parent -> child   line 1: {"tokenizer": backend JSON | null, "n_vocab": N, "eos": [...]}
                      then one line per schema: {"schema": "<schema JSON text>"}
    child -> parent   one line per schema: {"grammar": "..."} or {"error": "..."}

Why a process (workers.engine.grammar_compiler): llguidance gives no way to stop a compile,
and a 300-key `patternProperties` schema compiles for seconds to tens of seconds. A thread
would keep the event loop free (llguidance drops the GIL) but could not be stopped; a child
can be killed at the time budget, so the work ends when the budget does.

The check is the whole of what a request will need: the grammar from the schema, then a
matcher over the worker's tokenizer (the token-level lexer, the slow part), then its first
mask. A grammar whose matcher errs before the first token has no valid output (llguidance
reports most unsatisfiable schemas while compiling; a cycle of `$ref`s only here).
"""

from __future__ import annotations

import json
import sys
from typing import Any

# Compact JSON: no whitespace between tokens (a small model could emit blanks forever).
JSON_OPTIONS = {"whitespace_flexible": False}


def compile_schema(schema_json: str, view: Any) -> str:
    """The llguidance grammar of schema_json, checked to have a first token; ValueError why
    not. Without a tokenizer view (a test's character tokenizer) the grammar is validated
    alone."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults=JSON_OPTIONS)
    except (ValueError, RuntimeError) as exc:  # not a schema it can read
        raise ValueError(str(exc)) from None
    if view is None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(messages[0])
        return grammar
    matcher = llguidance.LLMatcher(view, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()  # a dead end shows only once the first mask is asked for
    if matcher.is_error():
        raise ValueError(_first_line(matcher.get_error()))
    return grammar


def _first_line(error: str) -> str:
    """llguidance appends its parser state after the reason (NoExtensionBias<state>...)."""
    reason = error.split("<state>", 1)[0].strip().splitlines()
    text = reason[0] if reason else error
    if text.startswith("NoExtensionBias"):
        return "Unsatisfiable schema: no output can match it (a cycle of $ref with no end?)"
    return text


def _view(setup: dict[str, Any]) -> Any:
    if setup.get("tokenizer") is None:
        return None
    import llguidance

    return llguidance.LLTokenizer(
        setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=list(setup["eos"])
    )


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    view = _view(setup)
    for line in sys.stdin:
        try:
            reply = {"grammar": compile_schema(json.loads(line)["schema"], view)}
        except ValueError as exc:
            reply = {"error": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
