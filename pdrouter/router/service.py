"""RouterService: one OpenAI request from its first byte to its last, on plain ASGI.

    accept   method, API key, body size, the body itself (400 naming the field), a request id
             not already in flight: all before any worker is touched
    enter    503 when no D answers, 429 when D's side or the router is full, 400 when the
             request can never fit (its whole bound reserved on D's side until its end)
    early    (on unless --no-early-decode) D picked and sent a prefetch beside P's prefill
             (orchestrator.prefetch); released at the end unless D's decode adopted it
    prefill  orchestrator.prefill (retried on another P)
    answer   stream: P's first token and the head leave back to back, then D's events;
             complete: one JSON answer
    end      once, whatever the outcome (_end): the status counted, the timeline closed, the
             log line, the in-flight slot given back; then D's body is read to its end

The two POST routes carry every relayed token, so RouterApp (app.py) routes them here ahead of
FastAPI's routing and middleware.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager

import httpx

from pdrouter.common.auth import api_keys, internal_headers, matching_api_key, require_bearer
from pdrouter.common.body_limit import BodyLimit, body_limit, declared_length, read_body
from pdrouter.common.error_mapping import api_error
from pdrouter.common.request_id import resolve_request_id
from pdrouter.router.asgi import (
    SSE_START_HEADERS,
    Receive,
    Scope,
    Send,
    header,
    json_bytes,
    send_api_error,
    send_json,
)
from pdrouter.router.config import RouterConfig
from pdrouter.router.disconnect_watch import DisconnectWatch
from pdrouter.router.instances.cache_events import events_loop
from pdrouter.router.instances.health import any_passes, health_loop
from pdrouter.router.instances.instance import Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.observability.timeline import TimelineRing
from pdrouter.router.observability.trace import make_tracer
from pdrouter.router.orchestrator import Answers, Hop, RequestContext
from pdrouter.router.orchestrator.choices import Flow
from pdrouter.router.orchestrator.prefetch import PREFETCH_READ_S, EarlyDecode
from pdrouter.router.relay import finish_parts, relay_sse
from pdrouter.router.request_end import record_answer, record_error
from pdrouter.router.selection.admission import (
    Admission,
    estimate_prompt_tokens,
    max_output_tokens,
)
from pdrouter.router.selection.breaker import BreakerBoard
from pdrouter.router.selection.policies import make_policy
from pdrouter.router.selection.selector import Selector
from pdrouter.router.tenancy.gate import Tenancy
from pdrouter.router.tenancy.key_metrics import KeyMetrics
from pdrouter.router.tenancy.keys_file import ApiKey
from pdrouter.router.upstream.contract import HopTimeout, Upstream
from pdrouter.router.upstream.factory import make_upstream
from pdrouter.router.worker_body import body_for_workers, with_priority
from pdrouter.wire.choices import plan_choices
from pdrouter.wire.errors import APIError, clip
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import (
    DECODE_PATH,
    PREFILL_PATH,
    REQUEST_ID_HEADER,
    Endpoint,
    cache_scope,
    tenant_of_key,
)
from pdrouter.wire.responses import SSE_DONE, sse
from pdrouter.wire.tool_stream import tool_answer

_REQUEST_ID_LOWER = REQUEST_ID_HEADER.lower().encode()
# How a request ends when its task is cancelled by anyone but its client (the server
# stopping): nobody gets an answer. Never raised, so one instance serves every request.
_CANCELLED = APIError(503, "request cancelled by the router, not by its client")


class RouterService:
    """Per-app state: the registry, the orchestrator, the ids of requests in flight."""

    def __init__(self, cfg: RouterConfig, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.breakers = BreakerBoard(cfg.breaker)
        registry.on_removed(lambda inst: self.breakers.forget(inst.url))
        registry.on_check_passed(lambda inst: self.breakers.health_passed(inst.url))
        registry.add_describer(lambda inst: {"breaker": self.breakers.state(inst.url).value})
        self.admission = Admission(cfg.admission)
        self.timelines = TimelineRing(cfg.timeline_capacity)
        self.metrics = RouterMetrics(registry, self.breakers)
        self.tenancy = Tenancy(cfg.tenancy, self.admission, KeyMetrics(self.metrics.registry))
        self.tracer = make_tracer(cfg.tracing)  # None: tracing off, nothing traced
        prefill_policy = make_policy(cfg.prefill_policy, cfg.cache_routing)
        policies = {"prefill": prefill_policy, "decode": make_policy(cfg.decode_policy)}
        self.selector = Selector(
            registry, policies, self.breakers, self.admission, self.tenancy.queue.extra_slots
        )
        self.client: httpx.AsyncClient | None = None  # control plane: health checks
        self.upstream: Upstream | None = None  # data path: P's and D's calls
        self.prefill_hop: Hop | None = None
        self.answers: Answers | None = None
        self.early: EarlyDecode | None = None  # None with --no-early-decode
        self.in_flight: set[str] = set()
        self._body_limit: tuple[int | None, BodyLimit] | None = None  # (max_model_len, bound)
        # Each API key's cache tenant, hashed once here, not per request (none when the
        # operator lets keys share the cache).
        self.tenants: dict[str, str | None] = {
            key: None if cfg.share_cache_across_keys else tenant_of_key(key)
            for key in api_keys(cfg.api_key)
        }

    def body_limit(self) -> BodyLimit:
        """The body bound of the OpenAI routes: --max-body-bytes, else derived from the
        longest context an instance serves (pdrouter.common.body_limit); made again only
        when that context changes (asked once per request)."""
        max_model_len = self.registry.max_model_len()
        cached = self._body_limit
        if cached is None or cached[0] != max_model_len:
            limit = body_limit(
                self.cfg.max_body_bytes,
                max_model_len,
                self.cfg.max_bytes_per_token,
                "the router's --max-body-bytes, --max-bytes-per-token",
            )
            cached = self._body_limit = (max_model_len, limit)
        return cached[1]

    async def start(self, upstream: Upstream | None = None) -> None:
        """Open the clients: upstream, the data path's (default: --upstream-client's; the path
        benchmark passes a scripted one), and the health checks'."""
        headers = internal_headers(self.cfg.internal_secret)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0), headers=headers)
        if upstream is None:
            upstream = make_upstream(self.cfg.upstream_client, 1024, headers)
        self.upstream = upstream
        self.tenancy.start()
        oc = self.cfg.orchestrator
        t = oc.timeouts
        self.prefill_hop = self._hop("prefill", PREFILL_PATH, t.prefill_s, upstream)
        decode_hop = self._hop("decode", DECODE_PATH, t.decode_event_s, upstream)
        self.answers = Answers(self.metrics, decode_hop, oc.missing_kv_policy)
        if oc.early_decode:
            bounds = HopTimeout(t.connect_s, PREFETCH_READ_S, t.write_s)
            self.early = EarlyDecode(
                self.selector, upstream, bounds, self.metrics, oc.local_prefill_below_tokens
            )

    def _hop(self, role: Role, path: str, read_s: float, upstream: Upstream) -> Hop:
        oc = self.cfg.orchestrator
        t = oc.timeouts
        max_attempts = oc.max_prefill_attempts if role == "prefill" else oc.max_decode_attempts
        timeout = HopTimeout(t.connect_s, read_s, t.write_s)
        return Hop(
            role,
            path,
            timeout,
            max_attempts,
            oc.retry_backoff_s,
            self.selector,
            self.registry,
            self.metrics,
            upstream,
        )

    async def stop(self) -> None:
        await self.tenancy.stop()
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.early is not None:
            await self.early.aclose()
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.client is not None:
            await self.client.aclose()

    async def health_loop(self) -> None:
        """The checks of every instance (instances.health), every P's cache events read."""
        assert self.client is not None
        cfg, policy = self.cfg, self.selector.policies["prefill"]
        await asyncio.gather(
            health_loop(self.registry, self.client, cfg.health_interval_s, cfg.heartbeat_ttl_s),
            events_loop(self.registry, policy, self.client, cfg.cache_routing.events_interval_s),
        )

    async def ensure_decode_reachable(self) -> None:
        """503 before any prefill work when no decode instance answers /health."""
        assert self.client is not None
        if self.registry.healthy("decode"):
            return
        timeout_s = self.cfg.orchestrator.timeouts.connect_s
        if not await any_passes(self.registry, self.client, "decode", timeout_s):
            detail = "; ".join(f"{i.url}: {i.last_error}" for i in self.registry.decode)
            raise APIError(
                503, f"no decode instance reachable ({detail})", stage="decode", retry_after_s=1
            )

    def check_api_key(self, authorization: str | None, key: ApiKey | None = None) -> str | None:
        """401 unless the header carries one of the API keys (when any is set); the prefix
        cache tenant of that key (None: no keys, or keys share the cache). A keys file's key
        (key, else looked up here) is its own tenant too."""
        if key is None and self.tenancy.keys is not None:
            key = self.tenancy.identify(authorization, self.cfg.api_key)
        if key is not None:
            return None if self.cfg.share_cache_across_keys else tenant_of_key(key.secret)
        if not self.tenants:
            return None
        key = matching_api_key(authorization, self.cfg.api_key)
        if key is None:
            require_bearer(None, self.cfg.api_key, "API key")  # raises the 401
        return self.tenants[key]  # type: ignore[index]

    def key_call(self, authorization: str | None) -> AbstractContextManager[None]:
        """A call that generates nothing (the tokenizer routes), counted against its
        keys-file key's call limits as a completion is (Tenancy.call)."""
        return self.tenancy.call(authorization, self.cfg.api_key)

    async def serve(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """One OpenAI request from its first byte to its last (RouterApp routes the two POST
        paths here). Every way it can end answers the client once, and ends the request once
        (_end): counted by its status, its timeline closed, its log line, and whatever it
        holds given back: its --max-in-flight slot, its id (its load on P and D is each
        attempt's, see orchestrator.attempts)."""
        arrival_s = time.monotonic()
        request_id = resolve_request_id(header(scope, _REQUEST_ID_LOWER))
        id_header = (_REQUEST_ID_LOWER, request_id.encode())
        ctx: RequestContext | None = None
        watch: DisconnectWatch | None = None
        parts: AsyncGenerator[bytes] | None = None  # a stream's parts
        holding = False
        started = False  # the 200 and its first bytes are out: errors travel in-band then
        error: APIError | None = _CANCELLED  # what it ends with: None for the answer
        try:
            try:
                ctx, stream = await self._accept(scope, receive, endpoint, request_id, arrival_s)
                await self._enter(ctx)
                holding = True
                self.in_flight.add(request_id)
                self.metrics.in_progress.inc()
                watch = DisconnectWatch(receive)
                ctx.task = watch.served
                assert self.prefill_hop is not None and self.answers is not None
                if self.early is not None:
                    self.early.start(ctx)
                flow = Flow(
                    self.prefill_hop,
                    self.answers,
                    ctx,
                    self.cfg.orchestrator.local_prefill_below_tokens,
                    ctx.plan,
                )
                if stream:
                    parts = await flow.stream()
                    # P's first token, built before the head goes out: the two leave back to
                    # back (the client wakes once for both, not once each).
                    first = await anext(parts)
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [*SSE_START_HEADERS, id_header],
                        }
                    )
                    started = True
                    await relay_sse(first, parts, send, watch)
                else:
                    answer = await flow.complete()
                    watch.finish()
                    await send_json(send, 200, json_bytes(answer), [id_header])
                error = None
            except asyncio.CancelledError:
                if watch is None or not watch.absorb():
                    raise
                gone = "client disconnected mid-stream" if started else "client disconnected"
                raise APIError(499, gone, "invalid_request_error") from None
        except Exception as exc:
            error = api_error(exc, "router", f"request {request_id}")
            if not started:
                await send_api_error(send, error, [id_header])
            elif error.status != 499:  # the head is out: an SSE event, then [DONE], ends it
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": False,
                        "body": sse(error.body()) + SSE_DONE,
                    }
                )
        finally:
            if watch is not None:
                watch.stop()
            self._end(request_id, endpoint, ctx, error, holding)
            if self.tracer is not None and ctx is not None:
                self.tracer.finish(ctx)
            if parts is not None:
                await finish_parts(parts, request_id, drain=error is None)

    async def _accept(
        self, scope: Scope, receive: Receive, endpoint: Endpoint, request_id: str, arrival_s: float
    ) -> tuple[RequestContext, bool]:
        """Everything checked before any worker is touched: method, API key, body size, the
        body itself (400 naming the field), a request id not already in flight."""
        key = self.tenancy.identify(header(scope, b"authorization"), self.cfg.api_key)
        tenant = self.check_api_key(header(scope, b"authorization"), key)  # before any 405
        if scope["method"] != "POST":
            raise APIError(
                405,
                f"method {clip(scope['method'])} not allowed on {clip(scope['path'])}",
                "invalid_request_error",
                extra_headers={"Allow": "POST"},
            )
        raw_bytes = await read_body(receive, self.body_limit(), declared_length(scope))
        request_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        parsed = parse_request(request_cls, raw_bytes)  # ProtocolError -> 400
        if request_id in self.in_flight:
            raise APIError(
                409,
                f"request id {request_id!r} is already in flight",
                "invalid_request_error",
                param=REQUEST_ID_HEADER,
                code="duplicate_request_id",
            )
        prompt_estimate = estimate_prompt_tokens(parsed)
        ctx = RequestContext(
            request_id,
            endpoint,
            body_for_workers(raw_bytes, parsed.seed),
            parsed.model,
            parsed.include_usage_in_stream(),
            arrival_s,
            prompt_estimate,
            max_output_tokens(parsed, self.registry.max_model_len(), prompt_estimate),
            cache_scope=cache_scope(tenant, parsed.cache_salt),
            tools=tool_answer(parsed),
            plan=plan_choices(parsed),
            system_fingerprint=self.registry.fingerprint,
            timeline=self.timelines.start(request_id, arrival_s),
            priority=parsed.priority,
            trace=self.tracer.start(header(scope, b"traceparent")) if self.tracer else None,
        )
        self.tenancy.admit(ctx, key, header(scope, b"x-priority"))  # 429 past a key's limit
        if ctx.priority != (parsed.priority or 0):  # the header's, the key's, or clamped
            ctx.body = with_priority(ctx.body, ctx.priority or 0)
        return ctx, bool(parsed.stream)

    async def _enter(self, ctx: RequestContext) -> None:
        """503 when no D answers, 429 when D's side or the router is full: before P works."""
        await self.ensure_decode_reachable()
        # beyond --max-in-flight: 429, or queued by priority; then 429 when D's side is full
        await self.tenancy.enter(ctx, functools.partial(self._reserve, ctx))

    def _reserve(self, ctx: RequestContext, priority: int) -> None:
        """Once it holds its --max-in-flight slot: its room, its bound reserved on the
        decode side until its end (_end; Selector.admit: 400 or 429 when it has none)."""
        calls = ctx.plan.num_prefill_calls if ctx.plan is not None else 1
        self.selector.admit(priority, ctx.num_tokens_bound, calls, ctx.prompt_tokens_estimate)
        ctx.num_tokens_reserved = ctx.num_tokens_bound

    def _end(
        self,
        request_id: str,
        endpoint: Endpoint,
        ctx: RequestContext | None,
        error: APIError | None,
        holding: bool,
    ) -> None:
        """The one end of every request (serve's finally), whatever its outcome: counted by
        its status, its timeline closed, its log line (the router runs uvicorn without an
        access log), its in-flight slot and id given back. error: None for the answer (then
        ctx.answered() says what it held), else what the client got; a client that left
        mid-stream counts as 499 whatever the status line said."""
        status = 200 if error is None else error.status
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if self.early is not None and ctx is not None:
            self.early.finish(ctx)  # its reservation on D released unless D adopted it
        if holding:
            self.in_flight.discard(request_id)
            self.metrics.in_progress.dec()
            if ctx is not None:
                self.selector.release("decode", ctx.num_tokens_reserved)
            self.tenancy.leave()  # after the release: a request waiting for room weighs it
        self.tenancy.end(ctx, status)
        if error is not None:
            record_error(self.metrics, request_id, endpoint, ctx, error)
        else:
            assert ctx is not None and ctx.answered_s, "a request answered 200 has its answer"
            record_answer(self.metrics, request_id, ctx)
