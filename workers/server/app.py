"""The worker's FastAPI app: thin handlers over OpenAIService, the engine loaded in background.

    GET  /health                 200 {role, model, fingerprint, block_size, ...} once ready, 503
                                 (with an API key or --router-only: {status} only, unless the
                                 caller holds the internal secret or the admin key)
    GET  /metrics                Prometheus text (per-app registry)
    GET  /v1/models              the served model names
    POST /v1/completions         OpenAI completions, stream or not
    POST /v1/chat/completions    OpenAI chat completions, stream or not
    POST /v1/responses           the Responses API, through the chat route (ResponsesMiddleware)

The port opens at once and the engine loads in a thread, so a launcher or router can tell
"loading" (503 + Retry-After) from "dead" (connection refused) while weights load.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pdrouter.common.auth import GateMiddleware, matching_api_key
from pdrouter.common.body_limit import (
    WORKER_BYTES_PER_TOKEN,
    BodyLimit,
    BodyLimitMiddleware,
    body_limit,
)
from pdrouter.common.doors import WORKER_DETAIL_PATH, worker_door
from pdrouter.common.request_id import RequestIdMiddleware, request_id_of
from pdrouter.common.responses_route import ResponsesMiddleware
from pdrouter.wire.choices import ChoicePlan, plan_choices
from pdrouter.wire.errors import unavailable
from pdrouter.wire.model_card import model_card
from pdrouter.wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ProtocolError,
    parse_request,
)
from pdrouter.wire.openapi import WORKER_STATUSES, install_openapi
from pdrouter.wire.pd import tenant_of_key
from pdrouter.wire.responses import SSE_HEADERS
from pdrouter.wire.worker import WorkerIdentity
from workers.engine.api import EngineStats
from workers.server import choices
from workers.server.config import AppConfig
from workers.server.cpu_work import CpuWork
from workers.server.errors import install_error_handlers
from workers.server.in_flight import InFlightLimitMiddleware
from workers.server.metrics import ServerMetrics
from workers.server.openai_service import OpenAIService, ServiceLimits
from workers.server.streaming import ClosingStreamingResponse
from workers.server.tokenize import install_tokenize_routes

if TYPE_CHECKING:
    from workers.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
# HTTP 499 (nginx's "client closed request"): logged for a non-stream client that left.
STATUS_CLIENT_CLOSED = 499


# Runs in the loading thread once the engine exists, before it starts: a P/D worker connects
# its pool client and builds its seam here, so /health turns 200 only when both are ready.
# It may return the identity completed (a P/D worker adds its handoff path), else None.
Attach = Callable[["AsyncEngine", WorkerIdentity], WorkerIdentity | None]


def worker_identity(engine: AsyncEngine, config: AppConfig) -> WorkerIdentity:
    """Who this worker is once engine has loaded (what /health and registration report)."""
    engine_cfg = engine.engine_config
    return WorkerIdentity(
        role=config.role,
        served_model_names=tuple(config.served_model_names),
        fingerprint=engine.fingerprint,
        block_size=engine_cfg.block_size,
        num_kv_blocks=engine.stats().num_kv_blocks_total,
        max_model_len=engine_cfg.max_model_len,
        max_num_seqs=engine_cfg.max_num_seqs,
        tensor_parallel_size=engine_cfg.tensor_parallel_size,
        num_kv_heads=getattr(engine.model_config, "num_kv_heads", None),
    )


class WorkerState:
    """The engine, its identity and the service once loaded; None before. One per app."""

    def __init__(
        self,
        config: AppConfig,
        engine_factory: Callable[[], AsyncEngine],
        attach: Attach | None = None,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self._attach = attach
        self.engine: AsyncEngine | None = None
        self.identity: WorkerIdentity | None = None
        self.service: OpenAIService | None = None
        self.load_error: BaseException | None = None
        self.metrics = ServerMetrics(self.stats)
        self.cpu = CpuWork()  # templating and tokenization, off the event loop
        # What can degrade a serving worker without stopping it (a P/D worker's pool client):
        # each answers None while fine, else why (/health shows "degraded" and the reasons).
        self.dependencies: list[Callable[[], str | None]] = []

    def degraded_reasons(self) -> list[str]:
        return [reason for check in self.dependencies if (reason := check()) is not None]

    def stats(self) -> EngineStats | None:
        """The engine's stats while it serves; None while loading or after it died."""
        if self.service is None or self.engine is None or not self.engine.is_healthy():
            return None
        return self.engine.stats()

    async def load(self, on_failure: Callable[[BaseException], None]) -> None:
        """Build the engine off the event loop, start it on the loop, then accept requests."""
        try:
            engine, identity = await asyncio.to_thread(self._load_in_thread)
            _reclaim_shutdown_signals()
            engine.start()
            self.engine, self.identity = engine, identity
            self.metrics.watch_grammars(engine.grammars.counts)
            limits = ServiceLimits(
                served_model_names=self.config.served_model_names,
                max_model_len=identity.max_model_len,
                max_pending_requests=self.config.max_pending_requests,
                system_fingerprint=identity.fingerprint,
            )
            self.service = OpenAIService(engine, self.metrics, limits, self.cpu)
            log.info("engine ready: %s", identity)
        except Exception as exc:
            log.exception("engine failed to load")
            self.load_error = exc
            on_failure(exc)

    def _load_in_thread(self) -> tuple[AsyncEngine, WorkerIdentity]:
        engine = self._engine_factory()
        engine.grammars.warm()  # the grammar's tokenizer view: here, not on the engine thread
        identity = worker_identity(engine, self.config)
        if self._attach is not None:
            identity = self._attach(engine, identity) or identity
        return engine, identity

    def require_service(self) -> OpenAIService:
        if self.service is None or self.engine is None:
            raise unavailable("the model is still loading; retry shortly", "not_ready", 2)
        if not self.engine.is_healthy():
            raise unavailable(
                f"the engine is down ({self.engine_error()}); this worker must be restarted",
                "engine_failed",
            )
        return self.service

    def engine_error(self) -> str:
        error = self.engine.error if self.engine is not None else self.load_error
        return repr(error) if error is not None else "stopped"

    def body_limit(self) -> BodyLimit:
        """The request body bound: --max-body-bytes, else derived from the context length."""
        return body_limit(
            self.config.max_body_bytes,
            None if self.identity is None else self.identity.max_model_len,
            WORKER_BYTES_PER_TOKEN,
            "the worker's --max-body-bytes",
        )

    def shutdown(self) -> None:
        self.cpu.shutdown()
        if self.engine is not None:
            self.engine.shutdown()


def _reclaim_shutdown_signals() -> None:
    """Re-arm Python's SIGTERM/SIGINT handlers (uvicorn's graceful shutdown) after Paddle loads.

    Importing Paddle (in the loader thread) installs a C-level failure handler for SIGTERM
    that prints a stack and aborts, so a plain `kill` would skip the shutdown that aborts
    in-flight requests. Python still records uvicorn's handlers: installing them again puts
    them back in front. Only the main thread may do this (uvicorn runs its loop there).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if callable(handler):
            signal.signal(sig, handler)


async def _wait_disconnect(request: Request) -> None:
    # The body is read already: the next message uvicorn delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def _liveness(state: WorkerState) -> Response:
    """/health for a caller without the detail credential: up or not, nothing else."""
    if state.service is None and state.load_error is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    if state.service is None or state.engine is None or not state.engine.is_healthy():
        return JSONResponse({"status": "failed"}, status_code=503)
    return JSONResponse({"status": "degraded" if state.degraded_reasons() else "ok"})


def create_app(
    config: AppConfig,
    engine_factory: Callable[[], AsyncEngine],
    on_load_failure: Callable[[BaseException], None] | None = None,
    lifespans: Sequence[Lifespan] = (),
    internal_secret: str | None = None,
    attach: Attach | None = None,
    router_only: bool = False,
) -> FastAPI:
    """The worker app; engine_factory (run in a thread) returns an unstarted AsyncEngine, and
    attach (same thread, after it) builds what a role adds over it (Attach).

    lifespans run inside the app's own (entered in order once the engine loader started,
    left in reverse before the engine shuts down): the P/D pool client's close, the
    registrar. internal_secret guards /internal/*; with config.api_key or router_only every
    other path but /health is locked too (pdrouter.common.doors.worker_door)."""
    state = WorkerState(config, engine_factory, attach)

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(state.load(on_load_failure or (lambda _exc: None)))
        try:
            async with AsyncExitStack() as stack:
                for extra in lifespans:
                    await stack.enter_async_context(extra(app_))
                yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(
        title=f"pdworker ({config.role})", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.router.redirect_slashes = False  # no redirect (its Location built from Host) on a "/"
    app.state.worker = state
    # Outermost last: the secret is checked before a body is read, every answer has its id.
    app.add_middleware(ResponsesMiddleware, body_limit=state.body_limit)
    app.add_middleware(BodyLimitMiddleware, limit=state.body_limit)
    app.add_middleware(InFlightLimitMiddleware, max_in_flight=config.max_pending_requests)
    app.add_middleware(RequestIdMiddleware)
    door = worker_door(config.api_key, internal_secret, config.admin_key, router_only)
    app.add_middleware(GateMiddleware, gate=door, routes=app.router.routes)
    install_error_handlers(app)
    install_openapi(app, WORKER_STATUSES)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not door.admits(WORKER_DETAIL_PATH, request.headers.get):
            return _liveness(state)
        if state.service is None and state.load_error is None:
            body = {"status": "loading", "role": config.role}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})
        if state.identity is None or state.engine is None or not state.engine.is_healthy():
            body = {"status": "failed", "role": config.role, "error": state.engine_error()}
            return JSONResponse(body, status_code=503)
        body = state.identity.health_body()
        if reasons := state.degraded_reasons():
            body = body.model_copy(update={"status": "degraded", "degraded": reasons})
        return JSONResponse(body.model_dump())

    _install_openai_routes(app, state)
    install_tokenize_routes(app, state)
    return app


async def _serve_choices(
    service: OpenAIService,
    parsed: Any,
    plan: ChoicePlan,
    body: bytes,
    request: Request,
    tenant: str | None,
) -> Response:
    request_id = request_id_of(request.scope)
    prepared = await choices.prepare_all(service, parsed, plan, body, request_id, tenant)
    if parsed.stream:
        return ClosingStreamingResponse(
            choices.stream_all(service, plan, prepared, request_id),
            on_close=lambda: [service.forget(one) for one in prepared.requests],
            headers=SSE_HEADERS,
        )
    answer = await choices.complete_all(service, plan, prepared, lambda: _wait_disconnect(request))
    if answer is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    return JSONResponse(answer)


def _install_openai_routes(app: FastAPI, state: WorkerState) -> None:
    """/metrics, /v1/models and the two OpenAI endpoints: thin handlers over the service."""
    config = state.config

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        max_len = None if state.identity is None else state.identity.max_model_len
        cards = [ModelCard(id=name, max_model_len=max_len) for name in config.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        max_len = None if state.identity is None else state.identity.max_model_len
        return JSONResponse(model_card(model_id, config.served_model_names, max_len).model_dump())

    async def serve(request: Request, request_cls: Any, endpoint: str) -> Response:
        service = state.require_service()
        try:
            parsed = parse_request(request_cls, body := await request.body())
        except ProtocolError:
            state.metrics.observe_request(endpoint, "rejected")
            raise
        # A client's key is its cache tenant (the internal secret's caller has none).
        key = matching_api_key(request.headers.get("authorization"), config.api_key)
        tenant = None if key is None else tenant_of_key(key)
        if (plan := plan_choices(parsed)) is not None:  # several sequences: workers.server.choices
            return await _serve_choices(service, parsed, plan, body, request, tenant)
        prepared = await service.prepare(parsed, request_id_of(request.scope), tenant)
        if prepared.stream:
            return ClosingStreamingResponse(
                service.stream(prepared),
                on_close=lambda: service.forget(prepared),
                headers=SSE_HEADERS,
            )
        answer = await service.complete(prepared, lambda: _wait_disconnect(request))
        if answer is None:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        return JSONResponse(answer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, "chat")
