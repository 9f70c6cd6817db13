"""RouterService: one OpenAI request from its first byte to its last, on plain ASGI.

    accept   method, API key, body size, the body itself (400 naming the field), a request id
             not already in flight: all before any worker is touched
    enter    503 when no D answers, 429 when D's side or the router is full
    prefill  orchestrator.prefill (retried on another P)
    answer   stream: P's first token and the head leave back to back, then D's events;
             complete: one JSON answer
    always   the client answered once, and whatever the request held given back once

The two POST routes carry every relayed token, so RouterApp (app.py) routes them here ahead of
FastAPI's routing and middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator

import httpx

from pdrouter.common.auth import internal_headers, require_bearer
from pdrouter.common.body_limit import BodyLimit, body_limit, declared_length, read_body
from pdrouter.common.request_id import resolve_request_id
from pdrouter.router.asgi import (
    SSE_START_HEADERS,
    Receive,
    Scope,
    Send,
    header,
    json_bytes,
    send_json,
)
from pdrouter.router.config import RouterConfig
from pdrouter.router.disconnect_watch import DisconnectWatch
from pdrouter.router.instances.health import any_passes, health_loop
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.observability.timeline import TimelineRing
from pdrouter.router.orchestrator import Orchestrator, RequestContext
from pdrouter.router.selection.admission import (
    Admission,
    estimate_prompt_tokens,
    max_output_tokens,
)
from pdrouter.router.selection.breaker import BreakerBoard
from pdrouter.router.selection.policies import make_policy
from pdrouter.router.upstream.contract import Upstream
from pdrouter.router.upstream.factory import make_upstream
from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)
from pdrouter.wire.pd import REQUEST_ID_HEADER, Endpoint
from pdrouter.wire.responses import SSE_DONE, sse

logger = logging.getLogger(__name__)

# The sampler takes any int seed; stay in 31 bits so every consumer's int type holds it.
_SEED_BITS = 31
# Seeds only need to differ between requests, not to be unpredictable: a per-process PRNG
# (seeded from os.urandom) instead of secrets, whose every call is a getrandom system call.
_seeds = random.Random()
_REQUEST_ID_LOWER = REQUEST_ID_HEADER.lower().encode()


def body_for_workers(raw: bytes, seed: int | None) -> bytes:
    """The client's body (already validated) as P and D get it: as sent, with a seed added
    when it has none (P samples the first token and D the rest: both must draw from one
    seed). The seed is spliced in before the first key; a body whose text might already
    spell a "seed" key (one set to null, or one written with \\u escapes) is decoded and
    encoded again instead, so that the added seed is the only one."""
    if seed is not None:
        return raw
    seed = _seeds.getrandbits(_SEED_BITS)
    text = raw.lstrip()
    if text[:1] == b"{" and b'"seed"' not in text and b"\\u" not in text:
        return b'{"seed":%d,%s' % (seed, text[1:])
    body = json.loads(raw)
    body["seed"] = seed
    return json_bytes(body)


async def _send_error(send: Send, exc: APIError, id_header: tuple[bytes, bytes]) -> None:
    """APIError as the plain-ASGI routes answer it: same body and headers as below."""
    headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
    await send_json(send, exc.status, json_bytes(exc.body()), [*headers, id_header])


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
        self.client: httpx.AsyncClient | None = None  # control plane: health checks
        self.upstream: Upstream | None = None  # data path: P's and D's calls
        self.orchestrator: Orchestrator | None = None
        self.in_flight: set[str] = set()

    def body_limit(self) -> BodyLimit:
        """The body bound of the OpenAI routes: --max-body-bytes, else derived from the
        longest context an instance serves (pdrouter.common.body_limit)."""
        return body_limit(
            self.cfg.max_body_bytes,
            self.registry.max_model_len(),
            self.cfg.max_bytes_per_token,
            "the router's --max-body-bytes, --max-bytes-per-token",
        )

    async def start(self) -> None:
        headers = internal_headers(self.cfg.internal_secret)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0), headers=headers)
        self.upstream = make_upstream(self.cfg.upstream_client, 1024, headers)
        self.orchestrator = Orchestrator(
            self.cfg.orchestrator,
            self.registry,
            make_policy(self.cfg.prefill_policy),
            make_policy(self.cfg.decode_policy),
            self.metrics,
            self.upstream,
            self.breakers,
            self.admission,
        )

    async def stop(self) -> None:
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.client is not None:
            await self.client.aclose()

    async def health_loop(self) -> None:
        """The periodic checks of every instance (instances.health.health_loop)."""
        assert self.client is not None
        await health_loop(
            self.registry, self.client, self.cfg.health_interval_s, self.cfg.heartbeat_ttl_s
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

    def check_api_key(self, authorization: str | None) -> None:
        require_bearer(authorization, self.cfg.api_key, "API key")

    async def serve(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """One OpenAI request from its first byte to its last (RouterApp routes the two POST
        paths here). Every way it can end answers the client once and gives back, once,
        whatever it holds: its --max-in-flight slot, its id, its load on P and D."""
        arrival_s = time.monotonic()
        request_id = resolve_request_id(header(scope, _REQUEST_ID_LOWER))
        id_header = (_REQUEST_ID_LOWER, request_id.encode())
        ctx: RequestContext | None = None
        watch: DisconnectWatch | None = None
        holding = False
        started = False  # the 200 and its first bytes are out: errors travel in-band then
        try:
            try:
                ctx, stream = await self._accept(scope, receive, endpoint, request_id, arrival_s)
                await self._enter(ctx)
                holding = True
                self.in_flight.add(request_id)
                self.metrics.in_progress.inc()
                watch = DisconnectWatch(receive)
                ctx.task = watch.served
                assert self.orchestrator is not None
                result = await self.orchestrator.prefill(ctx)
                if stream:
                    start = {"type": "http.response.start", "status": 200,
                             "headers": [*SSE_START_HEADERS, id_header]}  # fmt: skip
                    parts = self.orchestrator.stream(ctx, result)
                    async with contextlib.aclosing(parts):
                        # P's first token, built before the head goes out: the two leave
                        # back to back (the client wakes once for both, not once each).
                        first = await anext(parts)
                        await send(start)
                        started = True
                        await self._stream(first, parts, send, watch)
                else:
                    answer = await self.orchestrator.complete(ctx, result)
                    watch.finish()
                    await send_json(send, 200, json_bytes(answer), [id_header])
                    self.metrics.requests.labels(endpoint, "200").inc()
            except asyncio.CancelledError:
                if watch is None or not watch.absorb():
                    raise
                gone = "client disconnected mid-stream" if started else "client disconnected"
                raise APIError(499, gone, "invalid_request_error") from None
        except APIError as exc:
            self._refused(request_id, endpoint, ctx, exc)
            if not started:
                await _send_error(send, exc, id_header)
        except ProtocolError as exc:
            err = APIError(400, exc.message, "invalid_request_error", exc.param)
            self._refused(request_id, endpoint, ctx, err)
            await _send_error(send, err, id_header)
        except Exception:
            logger.exception("request %s: unhandled error", request_id)
            err = APIError(500, "internal router error; the router log has the details")
            self._refused(request_id, endpoint, ctx, err)
            if started:
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse(err.body()) + SSE_DONE})  # fmt: skip
            else:
                await _send_error(send, err, id_header)
        finally:
            if watch is not None:
                watch.stop()
            if holding:
                self.in_flight.discard(request_id)
                self.metrics.in_progress.dec()
                self.admission.leave()

    async def _accept(
        self, scope: Scope, receive: Receive, endpoint: Endpoint, request_id: str, arrival_s: float
    ) -> tuple[RequestContext, bool]:
        """Everything checked before any worker is touched: method, API key, body size, the
        body itself (400 naming the field), a request id not already in flight."""
        if scope["method"] != "POST":
            raise APIError(
                405,
                f"Method Not Allowed: {scope['method']} {scope['path']}",
                "invalid_request_error",
                extra_headers={"Allow": "POST"},
            )
        self.check_api_key(header(scope, b"authorization"))
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
        ctx = RequestContext(
            request_id,
            endpoint,
            body_for_workers(raw_bytes, parsed.seed),
            parsed.model,
            parsed.include_usage_in_stream(),
            arrival_s,
            estimate_prompt_tokens(parsed),
            max_output_tokens(parsed),
            system_fingerprint=self.registry.fingerprint,
            timeline=self.timelines.start(request_id, arrival_s),
        )
        return ctx, bool(parsed.stream)

    async def _enter(self, ctx: RequestContext) -> None:
        """503 when no D answers, 429 when D's side or the router is full: before P works."""
        await self.ensure_decode_reachable()
        assert self.orchestrator is not None
        self.orchestrator.ensure_room("decode")
        self.admission.enter()  # 429 beyond --max-in-flight; never a queue

    async def _stream(
        self, first: bytes, parts: AsyncIterator[bytes], send: Send, watch: DisconnectWatch
    ) -> None:
        """The SSE body: each part the orchestrator yields (P's first token, first, then D's
        events a network read at a time) is one write; the part that ends with [DONE] also
        ends the body."""
        ended = False
        part = first
        while True:
            if part.endswith(SSE_DONE):
                watch.finish()
                ended = True
            await send({"type": "http.response.body", "body": part, "more_body": not ended})
            part = await anext(parts, None)
            if part is None:
                break
        if not ended:
            watch.finish()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _refused(
        self, request_id: str, endpoint: Endpoint, ctx: RequestContext | None, exc: APIError
    ) -> None:
        """A request that ended in an error (or the client leaving): its log line (the router
        runs uvicorn without an access log: a completed request logs its own line, in the
        orchestrator), counted by its status, its timeline closed. A client leaving mid-stream
        counts as 499 too: what it got was cut short, whatever the status line said."""
        logger.info("request %s: %s answered %d: %s", request_id, endpoint, exc.status, exc.message)
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        if exc.status == 429:
            self.metrics.rejected.labels(exc.stage).inc()
        if ctx is not None and ctx.timeline is not None:
            ctx.timeline.end(exc.status, stage=exc.stage, error=exc.message)
