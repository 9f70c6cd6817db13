"""The OpenAI service of a mixed worker: parsed request in, response or SSE bytes out.

    handler -> await service.prepare(request, request_id)   400 for what cannot run, 503 full
            -> service.complete(prepared, wait_disconnect)   non-stream; aborts on disconnect
            |  service.stream(prepared)                      SSE bytes; aborts when closed early

Every path that ends without the engine finishing the request aborts it, so its KV blocks go
back to the pool: a client that disconnects, a cancelled handler, a failed engine call.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdrouter.wire.errors import APIError, bad_request, unavailable
from pdrouter.wire.logprobs import TokenLogprob, text_length
from pdrouter.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
)
from pdrouter.wire.pd import cache_scope
from pdrouter.wire.responses import SSE_DONE, ResponseFrame, sse_error
from pdrouter.wire.scoring import Scoring, scored
from pdrouter.wire.tool_stream import chat_frame
from workers.engine.api import EngineRequest, EngineStats, RequestOutput
from workers.server.cpu_work import CpuWork
from workers.server.logprobs import echoed_prompt, wire_logprobs
from workers.server.metrics import RequestStatus, ServerMetrics
from workers.server.prepare import PreparedRequest, check_model_name, prepare_request
from workers.server.structured import with_grammar, with_matcher

log = logging.getLogger(__name__)


class ServingEngine(Protocol):
    """What the service needs of workers.engine.async_engine.AsyncEngine."""

    tokenizer: Any
    grammars: Any  # builds a constrained request's matcher, off the engine thread

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def validate(self, request: EngineRequest) -> None: ...

    def stats(self) -> EngineStats: ...

    def is_healthy(self) -> bool: ...


@dataclass(frozen=True)
class ServiceLimits:
    served_model_names: tuple[str, ...]
    max_model_len: int
    # Requests held at once (running + queued in the engine); more get 503 + Retry-After.
    max_pending_requests: int
    system_fingerprint: str | None = None


@dataclass
class _Progress:
    """What one request has produced so far, with the times its metrics need."""

    arrival_s: float
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # engine SampledLogprobs, in order
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens from the device prefix cache
    num_host_cached_tokens: int = 0  # of them, swapped in from the host tier
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reason: Any = None
    prompt_logprobs: Any = None  # the engine's, when asked (echo with logprobs)
    first_token: asyncio.Event | None = None  # set at the first token (its prompt computed)

    def add(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            self.first_token_s = self.first_token_s or now
            if self.first_token is not None:
                self.first_token.set()
            self.last_token_s = now
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_host_cached_tokens = out.num_host_cached_tokens
        if out.new_text:
            self.text_parts.append(out.new_text)
        self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason


class OpenAIService:
    """Runs OpenAI requests on one engine; shared by all handlers of a mixed worker."""

    def __init__(
        self, engine: ServingEngine, metrics: ServerMetrics, limits: ServiceLimits, cpu: CpuWork
    ):
        self._engine = engine
        self._cpu = cpu
        self._metrics = metrics
        self._limits = limits
        self._in_flight: set[str] = set()
        # Sub-requests that are a group's later sequences (over()): the group is one request.
        self._forked: frozenset[str] = frozenset()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def engine(self) -> ServingEngine:
        return self._engine

    def over(self, engine: ServingEngine, forked: Iterable[str]) -> OpenAIService:
        """This service (its admissions, metrics and limits) running requests on engine: the
        sequences of one group (workers.server.group_streams); forked: the ids of its later
        sequences, counted in the metrics by their generated tokens alone (the group is one
        request, its prompt computed or hit once: its first sequence's)."""
        view = copy.copy(self)
        view._engine = engine
        view._forked = frozenset(forked)
        return view

    async def prepare(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        tenant: str | None = None,
    ) -> PreparedRequest:
        """Validate one request against the model and the engine; admit it or raise. The
        template and the tokenizer run on the CPU threads, never on the event loop. tenant:
        the client's key's (pdrouter.wire.pd.tenant_of_key); with the request's cache_salt
        it gives the cache scope its blocks are hashed under."""
        endpoint = "chat" if isinstance(request, ChatCompletionRequest) else "completion"
        try:
            check_model_name(request.model, self._limits.served_model_names)
            prepared = await self._cpu.run(
                prepare_request,
                request,
                request_id,
                self._engine.tokenizer,
                self._limits.max_model_len,
            )
            params = await with_grammar(prepared.params, prepared.constraint, self._engine.grammars)
            scope = cache_scope(tenant, request.cache_salt)
            prepared = dataclasses.replace(prepared, cache_scope=scope, params=params)
            try:
                self._engine.validate(prepared.engine_request())
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            if request_id in self._in_flight:
                raise APIError(
                    409,
                    f"request id {request_id!r} is already in flight",
                    "invalid_request_error",
                    code="duplicate_request_id",
                )
            if len(self._in_flight) >= self._limits.max_pending_requests:
                raise unavailable(
                    f"server is full ({len(self._in_flight)} requests pending); retry later",
                    "overloaded",
                )
        except APIError:
            # Refused before reaching the engine (bad input, duplicate id, full): "rejected".
            self._metrics.observe_request(endpoint, "rejected")
            raise
        self._in_flight.add(request_id)
        self._metrics.in_flight.set(len(self._in_flight))
        return prepared

    def builder(self, prepared: PreparedRequest) -> ResponseFrame:
        frame = ResponseFrame(
            endpoint="chat" if prepared.kind == "chat" else "completions",
            request_id=prepared.request_id,
            model=prepared.model,
            system_fingerprint=self._limits.system_fingerprint,
        )
        return chat_frame(frame, *prepared.tools)

    async def complete(
        self,
        prepared: PreparedRequest,
        wait_disconnect: Callable[[], Awaitable[Any]],
        first_token: asyncio.Event | None = None,
    ) -> dict[str, Any] | None:
        """The whole answer at once; None when the client went away first (request aborted).
        first_token: set when the first token is out (workers.server.choices waits on it)."""
        progress = _Progress(arrival_s=time.monotonic(), first_token=first_token)
        status: RequestStatus = "error"
        collect = asyncio.ensure_future(self._collect(prepared, progress))
        watch = asyncio.ensure_future(wait_disconnect())
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:
                status = "aborted"
                return None
            try:
                collect.result()
            except (RuntimeError, TimeoutError) as exc:
                # EngineDeadError (a RuntimeError) or no output for too long: the worker, not
                # the request, is at fault, and another worker may serve it.
                log.error("request %s failed in the engine: %r", prepared.request_id, exc)
                raise unavailable(
                    f"the engine could not run the request: {exc}", "engine_failed"
                ) from None
            status = "success"
            answer = self.builder(prepared).response(
                "".join(progress.text_parts),
                progress.finish_reason,
                progress.num_prompt_tokens,
                progress.num_output_tokens,
                self._logprobs(prepared, progress.logprobs),
                num_cached_tokens=progress.num_cached_tokens,
            )
            scoring = self._scoring(prepared, progress)
            return answer if scoring is None else scoring.response(answer)
        finally:
            if status != "success":
                # Abort first: the engine then ends the stream itself, so the collector below
                # finishes within one step even if its cancellation were lost.
                self._engine.abort(prepared.request_id)
            for task in (collect, watch):
                task.cancel()
            await asyncio.gather(collect, watch, return_exceptions=True)
            self._finish(prepared, progress, status)

    async def stream(
        self, prepared: PreparedRequest, first_token: asyncio.Event | None = None
    ) -> AsyncIterator[bytes]:
        """SSE bytes of the answer. Closing the iterator early aborts the request."""
        progress = _Progress(arrival_s=time.monotonic(), first_token=first_token)
        builder = self.builder(prepared)
        status: RequestStatus = "aborted"
        try:
            if builder.endpoint == "chat":
                yield builder.chunk("", first=True)  # the assistant role, before any token
            offset = 0  # completions' text_offset of the next token
            scoring: Scoring | None = None
            async for out in self._outputs(prepared):
                progress.add(out)
                scoring = scoring or self._scoring(prepared, progress)
                logprobs = self._logprobs(prepared, out.new_logprobs)
                if out.new_text or logprobs or (scoring and out.new_token_ids):
                    yield scored(
                        scoring, builder.chunk(out.new_text, logprobs=logprobs, text_offset=offset)
                    )
                    offset += text_length(logprobs or ())
                if out.finished:
                    yield scored(scoring, builder.chunk("", out.finish_reason))
            if prepared.include_usage:
                yield scored(
                    scoring,
                    builder.usage_chunk(
                        progress.num_prompt_tokens,
                        progress.num_output_tokens,
                        progress.num_cached_tokens,
                    ),
                )
            yield SSE_DONE
            status = "success"
        except Exception:
            # The 200 is already out: report in-band, as the openai client expects.
            log.exception("request %s failed mid-stream", prepared.request_id)
            status = "error"
            yield sse_error("the engine failed while generating; see the worker log")
            yield SSE_DONE
        finally:
            self._finish(prepared, progress, status)

    def _logprobs(self, prepared: PreparedRequest, entries: Any) -> list[TokenLogprob] | None:
        """entries as wire logprobs; None when the request asked for none."""
        if prepared.params.num_logprobs is None:
            return None
        return wire_logprobs(self._engine.tokenizer, entries)

    def _scoring(self, prepared: PreparedRequest, progress: _Progress) -> Scoring | None:
        """Echo and score-only's rewrite of the answer; None when not asked."""
        if not prepared.scoring:
            return None
        echoed = None
        if prepared.echo_text is not None:
            echoed = echoed_prompt(
                self._engine.tokenizer,
                prepared.echo_text,
                prepared.prompt_token_ids,
                progress.prompt_logprobs,
            )
        return Scoring(echoed, prepared.score_only)

    async def _collect(self, prepared: PreparedRequest, progress: _Progress) -> None:
        async for out in self._outputs(prepared):
            progress.add(out)

    async def ready(self, request: EngineRequest) -> EngineRequest:
        """request with its grammar state, built on the CPU threads (with_matcher)."""
        return await with_matcher(request, self._engine, self._cpu)

    async def _outputs(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        request = await self.ready(prepared.engine_request())
        async with contextlib.aclosing(self._engine.generate(request)) as outputs:
            async for out in outputs:
                yield out

    def forget(self, prepared: PreparedRequest) -> None:
        """A stream that closed before its generator ran: abort and release it all the same."""
        if prepared.request_id in self._in_flight:
            self._finish(prepared, _Progress(arrival_s=time.monotonic()), "aborted")

    def _finish(
        self, prepared: PreparedRequest, progress: _Progress, status: RequestStatus
    ) -> None:
        if status != "success":
            # Idempotent in the engine; this is what frees the blocks of a dropped client.
            self._engine.abort(prepared.request_id)
        self._in_flight.discard(prepared.request_id)
        self._metrics.in_flight.set(len(self._in_flight))
        self._count(prepared, progress, status)
        log.info(
            "request %s %s: %d prompt + %d generated tokens, finish %s",
            prepared.request_id,
            status,
            len(prepared.prompt_token_ids),
            progress.num_output_tokens,
            progress.finish_reason,
        )

    def _count(self, prepared: PreparedRequest, progress: _Progress, status: RequestStatus) -> None:
        """The request's metrics; a group's later sequence adds its generated tokens alone."""
        if prepared.request_id in self._forked:
            self._metrics.generation_tokens.inc(progress.num_output_tokens)
            return
        if progress.num_prompt_tokens:  # the engine ran it: where its prompt KV came from
            self._metrics.count_prompt_sources(
                device=progress.num_cached_tokens - progress.num_host_cached_tokens,
                host=progress.num_host_cached_tokens,
                computed=progress.num_prompt_tokens - progress.num_cached_tokens,
            )
        first, last = progress.first_token_s, progress.last_token_s
        tpot_s = None
        if first is not None and last is not None and progress.num_output_tokens > 1:
            tpot_s = (last - first) / (progress.num_output_tokens - 1)
        self._metrics.observe_request(
            prepared.kind,
            status,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            num_generated_tokens=progress.num_output_tokens,
            ttft_s=None if first is None else first - progress.arrival_s,
            tpot_s=tpot_s,
            e2e_s=None if last is None else last - progress.arrival_s,
        )
