"""A constrained request's grammar state is built off the engine thread: the tokenizer's view
at worker start, each request's matcher at admission on the server's CPU threads
(workers.server.structured.with_matcher); the engine step only masks and advances them.

A real tiny engine and OpenAIService in process; the engine's Grammars records which thread
built each view and matcher."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Sequence

import jsonschema
import pytest

from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ChatCompletionRequest, parse_request
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.grammar import GrammarMatcher, Grammars, compile_json_schema
from workers.server.cpu_work import CpuWork
from workers.server.metrics import ServerMetrics
from workers.server.openai_service import OpenAIService, ServiceLimits
from workers.server.structured import with_matcher

SCHEMA = {
    "type": "object",
    "properties": {"pet": {"enum": ["cat", "dog"]}},
    "required": ["pet"],
    "additionalProperties": False,
}


class RecordingGrammars(Grammars):
    """Grammars that note (what, thread name) for every view and matcher built."""

    def __init__(self, tokenizer: object, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self.built: list[tuple[str, str]] = []

    def view(self) -> object:
        if self._view is None:
            self.built.append(("view", threading.current_thread().name))
        return super().view()

    def matcher(self, grammar: str, replay_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        self.built.append(("matcher", threading.current_thread().name))
        return super().matcher(grammar, replay_token_ids)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    from workers.engine.loader import load_model
    from workers.engine.runner import ModelRunner

    loaded = load_model("tiny")
    config = EngineConfig(model="tiny", block_size=16, num_kv_blocks=32, max_model_len=256)
    llm = LLMEngine(ModelRunner(loaded, 32, 16), loaded.tokenizer, config,
                    loaded.config.vocab_size, loaded.config)  # fmt: skip
    llm.grammars = RecordingGrammars(loaded.tokenizer, loaded.config.vocab_size)
    llm.grammars.warm()  # what a worker does at start, on its loader thread
    async_engine = AsyncEngine(llm)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def _chat(**body: object) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "pet?"}], **body}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def test_the_engine_thread_never_builds_a_view_or_a_matcher(engine: AsyncEngine) -> None:
    grammars = engine.grammars
    # the view, once, at the fixture's warm(); then only the module's earlier tests' matchers
    assert grammars.built[0] == ("view", threading.current_thread().name)
    num_built = len(grammars.built)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    request = _chat(response_format=fmt, max_tokens=40, temperature=0)
    limits = ServiceLimits(("tiny",), 256, 8)

    async def serve() -> dict:
        cpu = CpuWork()
        service = OpenAIService(engine, ServerMetrics(lambda: None), limits, cpu)
        try:
            prepared = await service.prepare(request, "constrained")
            return await service.complete(prepared, asyncio.Event().wait)
        finally:
            cpu.shutdown()

    answer = asyncio.run(serve())
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    # one matcher, built on a CPU thread at admission; the view was never built again
    new = grammars.built[num_built:]
    assert [what for what, _ in new] == ["matcher"]
    assert new[0][1].startswith("cpu-work")
    assert [what for what, _ in grammars.built].count("view") == 1


def test_d_replays_the_tokens_it_is_given_at_admission(engine: AsyncEngine) -> None:
    grammar = compile_json_schema(json.dumps(SCHEMA))
    tokenizer = engine.tokenizer
    good = EngineRequest("d", (1, 2), SamplingParams(grammar=grammar),
                         output_token_ids=tuple(tokenizer.encode('{"pet":"c')))  # fmt: skip
    bad = EngineRequest("d2", (1, 2), SamplingParams(grammar=grammar),
                        output_token_ids=tuple(tokenizer.encode("hello")))  # fmt: skip

    async def admit(request: EngineRequest) -> EngineRequest:
        cpu = CpuWork()
        try:
            return await with_matcher(request, engine, cpu)
        finally:
            cpu.shutdown()

    ready = asyncio.run(admit(good))
    assert ready.matcher is not None and not ready.matcher.error
    free = EngineRequest("free", (1, 2), SamplingParams())
    assert asyncio.run(admit(free)) is free
    with pytest.raises(APIError) as info:
        asyncio.run(admit(bad))
    assert (info.value.status, info.value.param) == (400, "output_token_ids")
    assert "do not follow the request's grammar" in info.value.message
