"""The PD flow as a service: prefill on a P (with failover), then decode on a D (relayed).

    client ─► router ─► P  POST /internal/prefill   retried on another P before its result
                    ◄── PrefillResult (first token, KV handle)
             ◄─ first token (stream: at once)
                    ─► D  POST /internal/decode     another D if one cannot be reached;
                    ◄── DecodeEvent stream           resumed on another D if it dies mid-stream
             ◄─ relayed tokens, usage = prompt side from P + completion side from D

Handlers in router_app stay thin: they parse and call stream() or complete().
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdrouter.router.instances.call_guard import CallGuard
from pdrouter.router.instances.registry import Instance, Registry, Role
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.observability.timeline import Timeline
from pdrouter.router.selection.admission import Admission, AdmissionConfig, Hold
from pdrouter.router.selection.breaker import BreakerBoard, BreakerConfig, is_failure_status
from pdrouter.router.selection.policies import SelectionPolicy
from pdrouter.router.selection.selector import Selector
from pdrouter.router.upstream.contract import HopTimeout, Upstream
from pdrouter.router.upstream.decode_stream import event_batches
from pdrouter.wire.errors import RouterError
from pdrouter.wire.openai import error_body
from pdrouter.wire.pd import (
    DECODE_PATH,
    PREFILL_PATH,
    REQUEST_ID_HEADER,
    DecodeEvent,
    Endpoint,
    MissingKVPolicy,
    PrefillResult,
    decode_request_json,
    prefill_request_json,
)
from pdrouter.wire.responses import SSE_DONE, ResponseFrame, sse

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HopTimeouts:
    """Per-hop bounds; no call to a worker waits without one."""

    connect_s: float = 2.0
    prefill_s: float = 300.0  # the whole prefill answer (queue + compute + pool write)
    decode_event_s: float = 300.0  # the gap between two events of D's stream (first included)
    write_s: float = 10.0


@dataclass(frozen=True)
class OrchestratorConfig:
    timeouts: HopTimeouts = HopTimeouts()
    max_prefill_attempts: int = 3
    max_decode_attempts: int = 3
    retry_backoff_s: float = 0.05
    missing_kv_policy: MissingKVPolicy | None = None  # None: each decode instance's default


@dataclass
class RequestContext:
    """One client request on its way through the router."""

    request_id: str
    endpoint: Endpoint
    body: bytes  # the validated OpenAI body as JSON, seed fixed: what P and D get
    model: str
    include_usage: bool
    arrival_s: float  # time.monotonic() at arrival
    prompt_tokens_estimate: int = 1  # P's load before it has tokenized (admission)
    max_output_tokens: int = 0  # the client's output budget (0: unset)

    # The task serving the request (None: whichever task calls the orchestrator).
    task: asyncio.Task[Any] | None = None
    system_fingerprint: str | None = None
    # Where each hop ran (the last instance tried), for the request's log line.
    prefill_url: str = ""
    decode_urls: list[str] = field(default_factory=list)
    timeline: Timeline | None = None  # the debug timeline, when the app keeps one
    _frame: ResponseFrame | None = field(default=None, repr=False)

    def mark(self, event: str, **detail: Any) -> None:
        if self.timeline is not None:
            self.timeline.mark(event, **detail)

    def frame(self) -> ResponseFrame:
        """This request's ResponseFrame, made once, with the bytes its chunks share."""
        if self._frame is None:
            self._frame = ResponseFrame(
                self.endpoint,
                self.request_id,
                self.model,
                system_fingerprint=self.system_fingerprint,
            )
            _ = self._frame.text_chunk_parts  # computed now, with the frame's head
        return self._frame


def _stage_failure(stage: str, kinds: list[str], failures: list[str]) -> RouterError:
    """The client's error after every attempt of a stage failed: 503 (Retry-After) when no
    instance could be reached or all were overloaded, 502 when one failed outright."""
    detail = "; ".join(failures) or f"no {stage} instance left to try"
    if all(kind == "unreachable" for kind in kinds):
        return RouterError(
            503, f"no {stage} instance reachable ({detail})", stage=stage, retry_after_s=1
        )
    if all(kind in ("unreachable", "unavailable") for kind in kinds):
        return RouterError(
            503, f"no {stage} instance available ({detail})", stage=stage, retry_after_s=1
        )
    return RouterError(502, f"{stage} failed on every instance tried ({detail})", stage=stage)


class Orchestrator:
    """Runs requests through P then D; owns no sockets (the app passes its Upstream)."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        registry: Registry,
        prefill_policy: SelectionPolicy,
        decode_policy: SelectionPolicy,
        metrics: RouterMetrics,
        upstream: Upstream,
        breakers: BreakerBoard | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.metrics = metrics
        self.upstream = upstream
        t = cfg.timeouts
        self._prefill_timeout = HopTimeout(t.connect_s, t.prefill_s, t.write_s)
        self._decode_timeout = HopTimeout(t.connect_s, t.decode_event_s, t.write_s)
        self.selector = Selector(
            registry,
            self.policies,
            breakers if breakers is not None else BreakerBoard(BreakerConfig()),
            admission if admission is not None else Admission(AdmissionConfig()),
        )

    # -- selection --------------------------------------------------------------------------

    def pick(self, role: Role, exclude: set[str]) -> Instance | None:
        """The instance the next attempt goes to (see selection.Selector.pick)."""
        return self.selector.pick(role, exclude)

    def _pick_again(self, role: Role, tried: set[str], unreached: set[str]) -> Instance | None:
        """The next attempt's instance: one not tried yet, else one the request never reached.

        A connect (or pool) timeout means the call never got to the instance; under load it is
        often the router's own stall, not the instance. When no untried instance is left (the
        other one just died, say), such an instance gets another try while attempts last.
        """
        inst = self.pick(role, tried)
        if inst is None and unreached:
            inst = self.pick(role, tried - unreached)
        return inst

    def ensure_room(self, role: Role) -> None:
        self.selector.ensure_room(role)

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.cfg.retry_backoff_s * (2**attempt))

    # -- prefill ----------------------------------------------------------------------------

    async def prefill(self, ctx: RequestContext) -> PrefillResult:
        """P's result, retried on other P instances after a failure before the result."""
        payload = prefill_request_json(ctx.request_id, ctx.endpoint, ctx.body)
        # The answer's frame is made while P works (this runs when the task first waits),
        # rather than between P's answer and the first token's write.
        asyncio.get_running_loop().call_soon(ctx.frame)
        headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
        timeout = self._prefill_timeout
        tried: set[str] = set()
        unreached: set[str] = set()  # tried, but the call timed out before reaching it
        failures: list[str] = []
        kinds: list[str] = []  # per failure: unreachable | unavailable (503) | failed
        for attempt in range(self.cfg.max_prefill_attempts):
            inst = self._pick_again("prefill", tried, unreached)
            if inst is None:
                break
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            tried.add(inst.url)
            ctx.mark("prefill_sent", url=inst.url, attempt=attempt)
            verdict: bool | None = None  # stays None if the caller cancels this call
            try:
                num_tokens = ctx.prompt_tokens_estimate
                with Hold(inst, num_tokens), CallGuard(inst.calls, inst.url, ctx.task) as guard:
                    call = self.upstream.request(
                        "POST", inst.url + PREFILL_PATH, payload, headers, timeout
                    )
                    async with guard.entered(call) as resp:
                        await guard.call(resp.read())
                verdict = is_failure_status(resp.status_code)
            except httpx.HTTPError as exc:
                # The router's own connection pool full says nothing about the instance.
                verdict = None if isinstance(exc, httpx.PoolTimeout) else True
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                failures.append(f"{inst.url}: {reason}")
                self.metrics.stage_failures.labels("prefill", type(exc).__name__).inc()
                if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                    unreached.add(inst.url)
                if isinstance(exc, httpx.TimeoutException):
                    kinds.append("failed")  # slow, not dead: stays in rotation
                else:
                    kinds.append("unreachable")
                    self.registry.mark_down(inst, reason)
                ctx.mark("prefill_failed", url=inst.url, error=reason)
                await self._backoff(attempt)
                continue
            finally:
                self.selector.verdict(inst, verdict)
            if resp.status_code == 200:
                try:
                    result = PrefillResult.model_validate_json(resp.content)
                except ValueError as exc:  # a worker of another version, or a broken proxy
                    self.selector.verdict(inst, True)
                    failures.append(f"{inst.url}: malformed prefill result: {exc}")
                    kinds.append("failed")
                    await self._backoff(attempt)
                    continue
                self.metrics.account_prefill(result)
                self.metrics.prefill_s.observe(time.monotonic() - ctx.arrival_s)
                ctx.prefill_url = inst.url
                if ctx.timeline is not None:
                    ctx.timeline.record_prefill(inst.url, result)
                return result
            err = RouterError.from_upstream("prefill", inst.url, resp)
            if resp.status_code < 500:
                raise err
            kinds.append("unavailable" if resp.status_code == 503 else "failed")
            failures.append(f"{inst.url}: HTTP {resp.status_code}: {err.message}")
            self.metrics.stage_failures.labels("prefill", f"http_{resp.status_code}").inc()
            ctx.mark("prefill_failed", url=inst.url, error=f"HTTP {resp.status_code}")
            await self._backoff(attempt)
        raise _stage_failure("prefill", kinds, failures)

    # -- decode -----------------------------------------------------------------------------

    async def decode_events(
        self, ctx: RequestContext, result: PrefillResult
    ) -> AsyncIterator[list[DecodeEvent]]:
        """D's events after the first token, in batches (those one read brought in). A D that
        cannot be reached is skipped; one that dies mid-stream is replaced by another D that
        resumes after the tokens already sent."""
        output_ids = [result.first_token_id]
        tried: set[str] = set()
        unreached: set[str] = set()  # tried, but the call timed out before reaching it
        failures: list[str] = []
        kinds: list[str] = []
        headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
        timeout = self._decode_timeout
        for attempt in range(self.cfg.max_decode_attempts):
            inst = self._pick_again("decode", tried, unreached)
            if inst is None:
                break
            tried.add(inst.url)
            ctx.decode_urls.append(inst.url)
            payload = decode_request_json(
                ctx.request_id,
                ctx.endpoint,
                ctx.body,
                result.prompt_token_ids,
                output_ids,
                result.kv,
                self.cfg.missing_kv_policy,
            )
            num_tokens = len(result.prompt_token_ids) + ctx.max_output_tokens
            ctx.mark("decode_sent", url=inst.url, attempt=attempt)
            verdict: bool | None = None  # stays None if the client leaves mid-call
            num_events = 0  # events of this attempt: a failure after one is a failover
            try:
                with Hold(inst, num_tokens), CallGuard(inst.calls, inst.url, ctx.task) as guard:
                    call = self.upstream.request(
                        "POST", inst.url + DECODE_PATH, payload, headers, timeout
                    )
                    async with guard.entered(call) as resp:
                        if resp.status_code != 200:
                            await guard.call(resp.read())
                            err = RouterError.from_upstream("decode", inst.url, resp)
                            verdict = is_failure_status(resp.status_code)
                            if resp.status_code != 503:  # 4xx, or 502 under the `fail` policy
                                raise err
                            failures.append(f"{inst.url}: {err.message}")
                            kinds.append("unavailable")
                            self.metrics.stage_failures.labels("decode", "http_503").inc()
                        else:
                            # After the final batch the loop goes on only while event_batches
                            # reads D's body to its end, once the client has been served.
                            async for batch in event_batches(resp.chunks(), inst.url, guard):
                                for ev in batch:
                                    output_ids.extend(ev.token_ids)
                                    num_events += 1
                                    if ev.finished:
                                        verdict = False
                                        self._record_decode(ctx, inst, ev, result)
                                yield batch
                            if verdict is False:  # the final event came
                                return
                            verdict = True
                            failures.append(f"{inst.url}: stream ended before the request finished")
                            kinds.append("failed")
            except RouterError as exc:  # an in-band error event, or a 4xx/502 answer
                verdict = is_failure_status(exc.status) if verdict is None else verdict
                raise
            except httpx.HTTPError as exc:
                # The router's own connection pool full says nothing about the instance.
                verdict = None if isinstance(exc, httpx.PoolTimeout) else True
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                failures.append(f"{inst.url}: {reason}")
                self.metrics.stage_failures.labels("decode", type(exc).__name__).inc()
                if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                    unreached.add(inst.url)
                if isinstance(exc, httpx.ConnectError):
                    kinds.append("unreachable")
                else:
                    kinds.append("failed")
                if not isinstance(exc, httpx.TimeoutException):
                    self.registry.mark_down(inst, reason)
            finally:
                self.selector.verdict(inst, verdict)
            moved = "failover" if num_events else "retry"
            ctx.mark(f"decode_{moved}", url=inst.url, error=failures[-1] if failures else "")
            self.metrics.retries.labels("decode").inc()
            if num_events:  # the client has part of the answer: the next D resumes it
                self.metrics.failovers.labels("decode").inc()
            await self._backoff(attempt)
        raise _stage_failure("decode", kinds, failures)

    def _record_decode(
        self, ctx: RequestContext, inst: Instance, ev: DecodeEvent, result: PrefillResult
    ) -> None:
        """D's final event: pool and handoff metrics, and D's timings on the timeline."""
        self.metrics.account_decode(ev, result.kv)
        if ctx.timeline is not None:
            ctx.timeline.record_decode(inst.url, ev)

    def _finish_metrics(
        self, ctx: RequestContext, n_prompt: int, n_out: int, t_first: float, now: float
    ) -> None:
        self.metrics.prompt_tokens.inc(n_prompt)
        self.metrics.generation_tokens.inc(n_out)
        self.metrics.e2e_s.observe(now - ctx.arrival_s)
        if n_out > 1:
            self.metrics.tpot_s.observe((now - t_first) / (n_out - 1))
        logger.info(
            "request %s: %d prompt + %d output tokens in %.1f ms (first token at %.1f ms); "
            "prefill %s, decode %s",
            ctx.request_id, n_prompt, n_out, 1000 * (now - ctx.arrival_s),
            1000 * (t_first - ctx.arrival_s), ctx.prefill_url, " -> ".join(ctx.decode_urls) or "-",
        )  # fmt: skip

    def _relayed(self, ctx: RequestContext, batch: list[DecodeEvent], last_s: float) -> float:
        """Per relayed batch (the events of one read): each event's inter-token latency (the
        batch's arrival gap for its first event, 0 for the ones that came with it) and the
        first decode token's timeline mark; returns the time to measure the next gap from."""
        now = time.monotonic()
        first: DecodeEvent | None = None  # the batch's first event with tokens
        num_with_tokens = 0
        for ev in batch:
            if ev.token_ids:
                num_with_tokens += 1
                if first is None:
                    first = ev
        if first is None:
            return now
        self.metrics.itl_s.observe((now - last_s) / len(first.token_ids))
        if num_with_tokens > 1:  # the events that came with it: no gap
            self.metrics.itl_s.observe_many(0.0, num_with_tokens - 1)
        timeline = ctx.timeline
        if timeline is not None and not timeline.has("first_decode_token"):
            ctx.mark("first_decode_token")
        return now

    # -- the two answers --------------------------------------------------------------------

    async def stream(self, ctx: RequestContext, result: PrefillResult) -> AsyncIterator[bytes]:
        """SSE bytes for a streaming client: P's first token at once, then D's relayed."""
        frame = ctx.frame()
        n_prompt = len(result.prompt_token_ids)
        n_out = 1
        yield frame.chunk(result.first_text, result.finish_reason, first=True)
        t_first = last_s = time.monotonic()
        self.metrics.ttft_s.observe(t_first - ctx.arrival_s)
        ctx.mark("first_token_sent")
        if result.finish_reason is None:
            done = False
            try:
                # aclosing: a client that leaves closes D's stream now, not at garbage collection.
                async with contextlib.aclosing(self.decode_events(ctx, result)) as batches:
                    async for batch in batches:
                        # One write for the whole batch: each token stays its own SSE event.
                        parts = []
                        for ev in batch:
                            n_out = ev.num_output_tokens
                            if ev.finished:
                                parts.append(frame.chunk(ev.text, ev.finish_reason))
                            elif ev.text:
                                parts.append(frame.chunk(ev.text))
                        last_s = self._relayed(ctx, batch, last_s)
                        if batch[-1].finished:
                            # The final event's chunk and [DONE] leave in one write now; the
                            # loop then only lets event_batches read D's body to its end.
                            done = True
                            end_s = time.monotonic()
                            try:
                                yield self._last_write(frame, parts, ctx.include_usage,
                                                       n_prompt, n_out)  # fmt: skip
                            finally:
                                self._record_end(ctx, n_prompt, n_out, t_first, end_s)
                        elif parts:
                            yield b"".join(parts)
                return
            except RouterError as exc:
                if done:  # after [DONE]: the client has its whole answer
                    logger.warning("request %s, after its end: %s", ctx.request_id, exc.message)
                    return
                # Headers are gone already: the error travels as an SSE event, then [DONE].
                logger.warning("request %s: %s", ctx.request_id, exc.message)
                self.metrics.requests.labels(ctx.endpoint, str(exc.status)).inc()
                if ctx.timeline is not None:
                    ctx.timeline.end(exc.status, stage=exc.stage, error=exc.message)
                yield sse(error_body(exc.message, exc.err_type, exc.param, exc.code)) + SSE_DONE
                return
        end_s = time.monotonic()
        try:
            yield self._last_write(frame, [], ctx.include_usage, n_prompt, n_out)
        finally:
            self._record_end(ctx, n_prompt, n_out, t_first, end_s)

    @staticmethod
    def _last_write(frame: ResponseFrame, parts: list[bytes], include_usage: bool,
                    n_prompt: int, n_out: int) -> bytes:  # fmt: skip
        """The stream's last write: the final chunk, usage if asked for, [DONE]."""
        if include_usage:
            parts.append(frame.usage_chunk(n_prompt, n_out))
        return b"".join(parts) + SSE_DONE

    def _record_end(
        self, ctx: RequestContext, n_prompt: int, n_out: int, t_first: float, end_s: float
    ) -> None:
        """A stream's end (at end_s), recorded once its last write is out: metrics, the
        200, the timeline."""
        self._finish_metrics(ctx, n_prompt, n_out, t_first, end_s)
        self.metrics.requests.labels(ctx.endpoint, "200").inc()
        if ctx.timeline is not None:
            ctx.timeline.end(200, num_output_tokens=n_out)

    async def complete(self, ctx: RequestContext, result: PrefillResult) -> dict[str, Any]:
        """The whole non-streamed response."""
        texts = [result.first_text]
        finish_reason = result.finish_reason
        n_out = 1
        t_first = last_s = time.monotonic()
        self.metrics.ttft_s.observe(t_first - ctx.arrival_s)
        if finish_reason is None:
            async with contextlib.aclosing(self.decode_events(ctx, result)) as batches:
                async for batch in batches:
                    for ev in batch:
                        texts.append(ev.text)
                        n_out = ev.num_output_tokens
                        if ev.finished:
                            finish_reason = ev.finish_reason
                    last_s = self._relayed(ctx, batch, last_s)
        n_prompt = len(result.prompt_token_ids)
        self._finish_metrics(ctx, n_prompt, n_out, t_first, time.monotonic())
        if ctx.timeline is not None:
            ctx.timeline.end(200, num_output_tokens=n_out)
        return ctx.frame().response("".join(texts), finish_reason or "stop", n_prompt, n_out)
