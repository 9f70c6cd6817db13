"""The grammar a request's answer must follow, compiled for the engine (or a 400 naming why).

What to enforce is the wire's decision (`pdrouter.wire.structured.output_constraint`: a
response format or a forced tool call); compiling it is the engine's Grammars
(`workers.engine.grammar_compiler`: a child process within a size and a time budget, cached
by schema). P, D and the mixed worker all call with_grammar from the same body, before any
KV or pool work, so they run one grammar and a bad schema is a 400 before anything is held.
The compile is awaited on a thread (its child is killed at the budget): the event loop keeps
serving /health and every stream meanwhile. At admission each request's matcher is built
here too, on the CPU threads (with_matcher): the engine thread only masks and advances
matchers, it never builds one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pdrouter.wire.errors import bad_request, clip
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest
from pdrouter.wire.structured import OutputConstraint, output_constraint
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.grammar_compiler import GrammarBudgetError, GrammarError
from workers.server.cpu_work import CpuWork


def request_constraint(
    request: CompletionRequest | ChatCompletionRequest,
) -> OutputConstraint | None:
    """The schema request's answer must match; None when the answer is free text."""
    tools = request if isinstance(request, ChatCompletionRequest) else None
    return output_constraint(request.response_format, tools)


async def with_grammar(
    params: SamplingParams, constraint: OutputConstraint | None, grammars: Any
) -> SamplingParams:
    """params with the grammar of constraint (compiled off the event loop, within the
    worker's budget); 400 naming the parameter and why when it cannot be compiled."""
    if constraint is None:
        return params
    param = constraint.param
    try:
        # A schema seen before is answered here: no thread to wait for behind others' compiles.
        grammar = grammars.cached(constraint.schema_json)
        if grammar is None:
            grammar = await asyncio.to_thread(grammars.compile, constraint.schema_json)
    except GrammarBudgetError as exc:
        raise bad_request(f"{param}: {exc}", param, "grammar_budget_exceeded") from None
    except GrammarError as exc:
        raise bad_request(
            f"{param}: the schema cannot be compiled into a grammar: {clip(str(exc))}", param
        ) from None
    return dataclasses.replace(params, grammar=grammar)


async def with_matcher(request: EngineRequest, engine: Any, cpu: CpuWork) -> EngineRequest:
    """request with its grammar matcher (EngineRequest.matcher), built on the CPU threads from
    the engine's Grammars; a 400 when the outputs it brings (D's) do not follow the grammar."""
    if request.params.grammar is None:
        return request
    try:
        return await cpu.run(engine.grammars.ready, request)
    except ValueError as exc:  # GrammarError too
        param = "output_token_ids" if request.output_token_ids else None
        raise bad_request(clip(str(exc)), param) from None
