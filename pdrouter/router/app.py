"""The router's HTTP app: thin OpenAI handlers over the orchestrator, one error shape
(pdrouter.common.error_mapping, shared with the workers).

    POST /v1/completions, /v1/chat/completions   RouterService.serve (service.py), plain ASGI
    POST /v1/responses                           the chat path (common/responses_route.py)
    GET  /v1/models, /health, /metrics, /debug/requests/{id}, /instances*   FastAPI routes

The two POST routes carry every relayed token, so RouterApp serves them ahead of FastAPI's
routing and middleware. Middleware added with FastAPI's add_middleware would therefore skip
them without a word: RouterApp refuses add_middleware and says so. Wrap the whole app instead
(`app = YourMiddleware(app)`, pure ASGI), which every route goes through; middleware meant for
the FastAPI routes alone is added, by name, with add_fastapi_middleware.

Every answer carries X-Request-Id (the client's, or a new one), the same id every hop sees.
Every request first passes the router's door (pdrouter.common.doors.router_door: --api-key,
the keys of --api-keys-file, the admin key), ahead of both paths: with a key set, nothing but
the liveness probe answers without one. Every body read is bounded (service.body_limit): the
two POST routes and /v1/responses read theirs with read_body, the FastAPI routes (the
tokenizer routes, the admin API) behind BodyLimitMiddleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdrouter.common.auth import AuthGate, refuse, require_bearer, scope_header
from pdrouter.common.body_limit import ADMIN_BODY_LIMIT, BodyLimitMiddleware
from pdrouter.common.doors import ROUTER_ADMIN_PATHS, ROUTER_DETAIL_PATH, router_door
from pdrouter.common.error_mapping import install_error_handlers
from pdrouter.common.request_id import RequestIdMiddleware, resolve_request_id
from pdrouter.common.responses_route import ResponsesRoute
from pdrouter.router.asgi import Receive, Scope, Send
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.admin_api import install_instances_routes
from pdrouter.router.instances.registry import Registry
from pdrouter.router.service import RouterService
from pdrouter.router.tokenize_proxy import install_tokenize_routes
from pdrouter.wire.errors import APIError
from pdrouter.wire.model_card import model_card
from pdrouter.wire.openai import ModelCard, ModelList
from pdrouter.wire.openapi import ROUTER_STATUSES, install_openapi
from pdrouter.wire.pd import Endpoint
from pdrouter.wire.responses_api import RESPONSES_PATH

# The routes RouterApp serves itself, and the endpoint each one is.
OPENAI_ROUTES: dict[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


class RouterApp(FastAPI):
    """FastAPI, except that the OpenAI POST routes (OPENAI_ROUTES, any method: a GET gets
    405) go straight to RouterService.serve, ahead of FastAPI's middleware and routing.

    So that no middleware can skip them unnoticed, add_middleware raises: wrap the app
    (`app = Middleware(app)`) for every route, or call add_fastapi_middleware for the FastAPI
    routes alone."""

    service: RouterService
    door: AuthGate = router_door(None, None)
    responses: ResponsesRoute

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            f"RouterApp.add_middleware({getattr(middleware_class, '__name__', middleware_class)}"
            "): the router serves /v1/completions and /v1/chat/completions ahead of FastAPI's "
            "middleware stack, so this middleware would never see them. Wrap the whole app "
            "instead (app = Middleware(app), pure ASGI), or, for middleware meant for the "
            "other routes only, call add_fastapi_middleware."
        )

    def add_fastapi_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Middleware for the FastAPI routes only (never the two OpenAI POST routes)."""
        super().add_middleware(middleware_class, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = OPENAI_ROUTES.get(scope["path"])
            if endpoint is not None:
                # The same door (the API key), checked inside serve so a 401 is counted.
                await self.service.serve(scope, receive, send, endpoint)
                return
            header = scope_header(scope)
            if not self.door.admits(scope["path"], header):  # before any 405: the key first
                request_id = resolve_request_id(header("x-request-id")).encode()
                await refuse(self.door, scope, send, [(b"x-request-id", request_id)])
                return
            if scope["path"] == RESPONSES_PATH:  # served by the chat path (after the door)
                await self.responses(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _install_body_bound(app: RouterApp, service: RouterService) -> None:
    """Every body a FastAPI route reads (the tokenizer routes, the admin API) within a bound:
    the OpenAI routes' (a /tokenize body is a prompt), the admin API's own (ADMIN_BODY_LIMIT);
    unbounded, 8 x 100 MB /tokenize bodies took the router to 2 GB resident. Added before
    RequestIdMiddleware, so inside it: a refused body's answer carries the request id too."""
    admin_bound = tuple((path, ADMIN_BODY_LIMIT) for path in ROUTER_ADMIN_PATHS)
    app.add_fastapi_middleware(
        BodyLimitMiddleware, limit=service.body_limit, path_limits=admin_bound
    )


def create_app(cfg: RouterConfig, registry: Registry) -> RouterApp:
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

    # No trailing-slash redirects: Starlette builds their Location from the Host header.
    app = RouterApp(title="pdrouter", lifespan=lifespan, redirect_slashes=False)
    app.service = service
    app.responses = ResponsesRoute(
        lambda scope, receive, send: service.serve(scope, receive, send, "chat"), service.body_limit
    )
    app.door = router_door(cfg.api_key, cfg.admin_key, service.tenancy.keys)
    app.state.service = service
    _install_body_bound(app, service)
    # The OpenAI routes resolve their request id themselves (RouterService.serve).
    app.add_fastapi_middleware(RequestIdMiddleware)
    install_error_handlers(app, "router")
    install_openapi(app, ROUTER_STATUSES, app.door)
    install_instances_routes(app, registry, cfg.admin_key, cfg.heartbeat_ttl_s)
    install_tokenize_routes(app, registry, lambda: service.client, service.key_call)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.check_api_key(request.headers.get("authorization"))
        max_len = registry.max_model_len()
        cards = [ModelCard(id=name, max_model_len=max_len) for name in registry.models()]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        service.check_api_key(request.headers.get("authorization"))
        return model_card(model_id, registry.models(), registry.max_model_len()).model_dump()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ok = bool(registry.healthy("prefill")) and bool(registry.healthy("decode"))
        status = "ok" if ok else "degraded"
        if not app.door.admits(ROUTER_DETAIL_PATH, request.headers.get):
            return JSONResponse({"status": status}, status_code=200 if ok else 503)  # liveness
        body = {
            "status": status,
            "role": "router",
            "pid": os.getpid(),  # the launcher checks that the server it reached is its own
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
            raise APIError(
                404,
                f"no timeline for request {request_id!r} (unknown, or older than the "
                f"{service.timelines.capacity} most recent requests)",
                "invalid_request_error",
                code="unknown_request_id",
            )
        return timeline.to_json()

    return app
