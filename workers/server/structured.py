"""The grammar a request's answer must follow, compiled for the engine (or a 400 naming why).

What to enforce is the wire's decision (`pdrouter.wire.structured.output_constraint`: a
response format or a forced tool call); compiling it is llguidance's
(`workers.engine.grammar.compile_json_schema`, cached by schema). P, D and the mixed worker
all call this from the same body, so they run one grammar. At admission each request's
matcher is built here too, on the CPU threads (with_matcher): the engine thread only masks and
advances matchers, it never builds one.
"""

from __future__ import annotations

from typing import Any

from pdrouter.wire.errors import bad_request, clip
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest
from pdrouter.wire.structured import output_constraint
from workers.engine.api import EngineRequest
from workers.engine.grammar import GrammarError, compile_json_schema
from workers.server.cpu_work import CpuWork


def request_grammar(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The llguidance grammar of request's answer; None when the answer is free text."""
    tools = request if isinstance(request, ChatCompletionRequest) else None
    constraint = output_constraint(request.response_format, tools)
    if constraint is None:
        return None
    try:
        return compile_json_schema(constraint.schema_json)
    except GrammarError as exc:
        raise bad_request(
            f"{constraint.param}: the schema cannot be compiled into a grammar: {clip(str(exc))}",
            constraint.param,
        ) from None


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
