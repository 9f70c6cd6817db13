"""GET /internal/cache/events and /internal/cache/snapshot: a P's cache events for routers.

Both read the engine's BlockEventLog (workers/engine/block_events.py; the wire shapes are
pdrouter.wire.cache_events) and sit behind the internal secret like every /internal path.
A worker without prefix caching has no log: 404 cache_events_off (a router then steers by
load alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdrouter.wire.cache_events import CACHE_EVENTS_PATH, CACHE_SNAPSHOT_PATH
from pdrouter.wire.errors import bad_request, not_found

if TYPE_CHECKING:
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.block_events import BlockEventLog


def install_cache_event_routes(app: FastAPI, engine_of: Callable[[], AsyncEngine]) -> None:
    """The two routes over engine_of()'s log (engine_of raises 503 while loading)."""

    def log_of() -> BlockEventLog:
        events = engine_of().block_events
        if events is None:
            raise not_found("this worker's prefix cache is off", code="cache_events_off")
        return events

    @app.get(CACHE_EVENTS_PATH)
    async def cache_events(request: Request) -> Response:
        raw = request.query_params.get("since", "0")
        try:
            since = int(raw)
        except ValueError:
            raise bad_request(f"since must be an integer, got {raw[:32]!r}", "since") from None
        answer = log_of().since(since)
        return Response(answer.model_dump_json(), media_type="application/json")

    @app.get(CACHE_SNAPSHOT_PATH)
    async def cache_snapshot() -> Response:
        answer = log_of().snapshot()
        return Response(answer.model_dump_json(), media_type="application/json")
