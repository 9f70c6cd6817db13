"""The router's HTTP app: thin OpenAI handlers over the Orchestrator, one error shape.

    POST /v1/completions, /v1/chat/completions   parse (400 before any worker is touched),
                                                 prefill, then stream or assemble the answer
    GET  /v1/models, /health, /metrics

Every answer carries X-Request-Id (the client's, or a new one), the same id every hop sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdrouter.admission import Admission, AdmissionConfig
from pdrouter.auth import internal_headers, require_bearer
from pdrouter.breaker import BreakerBoard, BreakerConfig
from pdrouter.errors import RouterError
from pdrouter.instances_api import install_instances_routes
from pdrouter.metrics import RouterMetrics
from pdrouter.orchestrator import Orchestrator, OrchestratorConfig, RequestContext
from pdrouter.pd_protocol import REQUEST_ID_HEADER, Endpoint
from pdrouter.policies import make_policy
from pdrouter.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ProtocolError,
    parse_request,
)
from pdrouter.registry import Registry
from pdrouter.request_id import RequestIdMiddleware, resolve_request_id
from pdrouter.timeline import TimelineRing
from pdrouter.upstream_transport import make_upstream_transport

logger = logging.getLogger(__name__)

# The sampler takes any int seed; stay in 31 bits so every consumer's int type holds it.
_MAX_SEED = 2**31
T = TypeVar("T")


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    health_interval_s: float = 1.0
    startup_wait_s: float = 60.0
    api_key: str | None = None
    admin_key: str | None = None  # /instances* (and other admin endpoints); None: open
    internal_secret: str | None = None  # sent to workers on every hop (X-PD-Internal-Secret)
    heartbeat_ttl_s: float = 10.0  # a registered instance silent this long is removed
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    timeline_capacity: int = 1024  # recent requests whose timeline /debug/requests keeps
    upstream_client: str = "auto"  # aiohttp | httpx | auto (pdrouter.upstream_transport)


def _error_response(exc: RouterError, request_id: str | None = None) -> JSONResponse:
    headers = exc.headers()
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_router_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RouterError)
        return _error_response(exc, getattr(request.state, "request_id", None))

    async def on_protocol_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProtocolError)
        return _error_response(RouterError(400, exc.message, "invalid_request_error", exc.param))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(RouterError(exc.status_code, message, err_type))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = RouterError(500, "internal router error; the router log has the details")
        return _error_response(err, getattr(request.state, "request_id", None))

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(ProtocolError, on_protocol_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


class RouterService:
    """Per-app state: the registry, the orchestrator, the ids of requests in flight."""

    def __init__(self, cfg: RouterConfig, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.breakers = BreakerBoard(cfg.breaker)
        registry.on_removed(lambda inst: self.breakers.forget(inst.url))
        self.admission = Admission(cfg.admission)
        self.timelines = TimelineRing(cfg.timeline_capacity)
        self.metrics = RouterMetrics(registry, self.breakers)
        self.client: httpx.AsyncClient | None = None
        self.orchestrator: Orchestrator | None = None
        self.in_flight: set[str] = set()

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=128)
        self.client = httpx.AsyncClient(
            limits=limits,
            transport=make_upstream_transport(self.cfg.upstream_client, 1024),
            timeout=httpx.Timeout(10.0),
            headers=internal_headers(self.cfg.internal_secret),
        )
        self.orchestrator = Orchestrator(
            self.cfg.orchestrator,
            self.registry,
            make_policy(self.cfg.prefill_policy),
            make_policy(self.cfg.decode_policy),
            self.metrics,
            self.client,
            self.breakers,
            self.admission,
        )

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def health_loop(self) -> None:
        """Re-check every instance; a restarted worker comes back within one interval."""
        assert self.client is not None
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            self.registry.expire_heartbeats(self.cfg.heartbeat_ttl_s)
            with contextlib.suppress(httpx.HTTPError):
                await self.registry.check_all(self.client, min(2.0, self.cfg.health_interval_s))

    async def ensure_decode_reachable(self) -> None:
        """503 before any prefill work when no decode instance answers /health."""
        assert self.client is not None
        if self.registry.healthy("decode"):
            return
        # One passing check is enough to try it (the health threshold is for the rotation).
        timeout_s = self.cfg.orchestrator.timeouts.connect_s
        decodes = self.registry.routable("decode")
        passed = await asyncio.gather(
            *(self.registry.check(self.client, inst, timeout_s) for inst in decodes)
        )
        if not any(passed):
            detail = "; ".join(f"{i.url}: {i.last_error}" for i in self.registry.decode)
            raise RouterError(
                503, f"no decode instance reachable ({detail})", stage="decode", retry_after_s=1
            )

    def check_api_key(self, request: Request) -> None:
        require_bearer(request.headers.get("authorization"), self.cfg.api_key, "API key")

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        arrival_s = time.monotonic()
        self.check_api_key(request)
        request_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        raw_bytes = await request.body()
        parsed = parse_request(request_cls, raw_bytes)  # ProtocolError -> 400
        body: dict[str, Any] = json.loads(raw_bytes)
        # Resolved by RequestIdMiddleware; resolved here when the app runs without it.
        request_id = getattr(request.state, "request_id", None) or resolve_request_id(
            request.headers.get(REQUEST_ID_HEADER)
        )
        request.state.request_id = request_id
        if request_id in self.in_flight:
            raise RouterError(
                409,
                f"request id {request_id!r} is already in flight",
                "invalid_request_error",
                param=REQUEST_ID_HEADER,
                code="duplicate_request_id",
            )
        if parsed.seed is None:
            # P samples the first token and D the rest: both must draw from one seed.
            body["seed"] = secrets.randbelow(_MAX_SEED)
        ctx = RequestContext(
            request_id,
            endpoint,
            body,
            parsed.include_usage_in_stream(),
            arrival_s,
            system_fingerprint=self.registry.fingerprint,
            timeline=self.timelines.start(request_id, arrival_s),
        )
        try:
            await self.ensure_decode_reachable()
            assert self.orchestrator is not None
            self.orchestrator.ensure_room("decode")
            self.admission.enter()  # 429 beyond --max-in-flight; never a queue
        except RouterError as exc:
            self._refused(ctx, exc)
            raise
        self.in_flight.add(request_id)
        self.metrics.in_progress.inc()
        handed_off = False
        try:
            result = await self._unless_gone(request, self.orchestrator.prefill(ctx))
            headers = {REQUEST_ID_HEADER: request_id}
            if parsed.stream:
                handed_off = True
                release = self._releaser(request_id)
                return StreamingResponse(
                    self._tracked(self.orchestrator.stream(ctx, result), release),
                    media_type="text/event-stream",
                    headers={**headers, "Cache-Control": "no-cache"},
                    background=BackgroundTask(release),
                )
            answer = await self._unless_gone(request, self.orchestrator.complete(ctx, result))
            self.metrics.requests.labels(endpoint, "200").inc()
            return JSONResponse(answer, headers=headers)
        except RouterError as exc:
            self._refused(ctx, exc)
            raise
        finally:
            if not handed_off:
                self.in_flight.discard(request_id)
                self.metrics.in_progress.dec()
                self.admission.leave()

    def _refused(self, ctx: RequestContext, exc: RouterError) -> None:
        """A request answered with an error status: count it and close its timeline."""
        self.metrics.requests.labels(ctx.endpoint, str(exc.status)).inc()
        if exc.status == 429:
            self.metrics.rejected.labels(exc.stage).inc()
        if ctx.timeline is not None:
            ctx.timeline.end(exc.status, stage=exc.stage, error=exc.message)

    def _releaser(self, request_id: str) -> Callable[[], Awaitable[None]]:
        """Gives back what a streamed request holds, once, whichever comes first: the end of
        its stream, or the response's background task. The latter matters when the client
        leaves before the first byte: the stream generator then never starts, so no finally
        of it runs, and without this the request would hold its --max-in-flight slot forever."""
        released = False

        async def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.in_flight.discard(request_id)
            self.metrics.in_progress.dec()
            self.admission.leave()
            timeline = self.timelines.get(request_id)
            if timeline is not None:
                timeline.end(499, error="client disconnected mid-stream")  # no-op if ended

        return release

    async def _tracked(
        self, chunks: AsyncIterator[bytes], release: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[bytes]:
        """Relays chunks; closing it (client gone) closes D's stream, which aborts D's request."""
        try:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    yield chunk
        finally:
            await release()

    async def _unless_gone(self, request: Request, work: Awaitable[T]) -> T:
        """work's result; if the client disconnects first, work is cancelled (closing its
        upstream connection, which aborts the request on that worker) and 499 is raised."""

        async def wait_gone() -> None:
            # The body is read already: the next message uvicorn delivers is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        job = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(wait_gone())
        try:
            await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():
                raise RouterError(499, "client disconnected", "invalid_request_error")
            return job.result()
        finally:
            for task in (job, watch):
                task.cancel()
            await asyncio.gather(job, watch, return_exceptions=True)


def create_app(cfg: RouterConfig, registry: Registry) -> FastAPI:
    """The router app over a registry whose startup check (fingerprints) already passed."""
    service = RouterService(cfg, registry)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        health = asyncio.ensure_future(service.health_loop())
        try:
            yield
        finally:
            health.cancel()
            await asyncio.gather(health, return_exceptions=True)
            await service.stop()

    app = FastAPI(title="pdrouter", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(RequestIdMiddleware)
    _install_error_handlers(app)
    install_instances_routes(app, registry, cfg.admin_key, cfg.heartbeat_ttl_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.check_api_key(request)
        return ModelList(data=[ModelCard(id=name) for name in registry.models()]).model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bool(registry.healthy("prefill")) and bool(registry.healthy("decode"))
        body = {
            "status": "ok" if ok else "degraded",
            "role": "router",
            "fingerprint": registry.fingerprint,
            "models": registry.models(),
            "num_prefill_healthy": len(registry.healthy("prefill")),
            "num_decode_healthy": len(registry.healthy("decode")),
            "instances": registry.snapshot(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/requests/{request_id}")
    async def debug_request(request_id: str, request: Request) -> dict[str, Any]:
        require_bearer(request.headers.get("authorization"), cfg.admin_key, "admin key")
        timeline = service.timelines.get(request_id)
        if timeline is None:
            raise RouterError(
                404,
                f"no timeline for request {request_id!r} (unknown, or older than the "
                f"{service.timelines.capacity} most recent requests)",
                "invalid_request_error",
                code="unknown_request_id",
            )
        return timeline.to_json()

    return app
