"""What the prefill and decode roles share: flags, the pool client, metrics, the app shell.

A PD worker is the mixed worker's app (same /health, /metrics, /v1/*, engine loading) plus one
internal endpoint and a KVPoolClient. The pool client connects in the engine-loading thread,
after the engine exists (its staging slot size is one block of every layer of this engine's
cache), so /health turns 200 only when both are ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from prometheus_client import Counter, Histogram

from pdrouter.wire.errors import unavailable
from workers.server.app import Lifespan
from workers.server.cache_metrics import CacheMetrics
from workers.server.config import PDSettings, WorkerConfig
from workers.server.registration import registration_body, registration_lifespan

log = logging.getLogger(__name__)
T = TypeVar("T")
_STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class PDMetrics:
    """Pool traffic and handoff stage times, on the worker's own registry."""

    def __init__(self, registry: Any) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pdworker_{name}", doc, registry=registry)

        def stage(name: str, doc: str) -> Histogram:
            return Histogram(
                f"pdworker_{name}_seconds", doc, buckets=_STAGE_BUCKETS_S, registry=registry
            )

        self.bytes_written = counter("pool_bytes_written", "KV bytes put into the pool")
        self.blocks_written = counter("pool_blocks_written", "KV blocks put into the pool")
        self.blocks_skipped = counter("pool_blocks_skipped", "KV blocks already in the pool")
        self.bytes_read = counter("pool_bytes_read", "KV bytes read from the pool")
        self.blocks_loaded = counter("pool_blocks_loaded", "KV blocks loaded from the pool")
        self.blocks_missing = counter("pool_blocks_missing", "KV blocks the pool did not have")
        self.tokens_recomputed = counter(
            "prompt_tokens_recomputed", "prompt tokens recomputed for missing blocks"
        )
        self.compute_s = stage("prefill_compute", "engine add to first token (queue + prefill)")
        self.d2h_s = stage("d2h", "swap_cache_layout device -> host per request")
        self.put_s = stage("pool_put", "pool exists + put per request")
        self.write_wait_s = stage(
            "pool_write_wait",
            "prefill: of d2h + pool put, the time waited after the first token (the rest ran "
            "while later chunks computed)",
        )
        self.blocks_written_early = counter(
            "pool_blocks_written_early",
            "prefill: prompt KV blocks whose write started while later chunks of the prompt "
            "computed (written, or skipped as already in the pool)",
        )
        self.get_s = stage("pool_get", "pool get per request")
        self.h2d_s = stage("h2d", "swap_cache_layout host -> device per request")


class PDContext:
    """The pieces a role handler needs; pool is set once the engine has loaded."""

    def __init__(self, app: FastAPI, settings: PDSettings) -> None:
        self.app = app
        self.settings = settings
        self.worker = app.state.worker  # workers.server.app.WorkerState
        self.pool: Any = None  # workers.pool.client.KVPoolClient
        self.metrics = PDMetrics(self.worker.metrics.registry)
        self.cache_metrics = CacheMetrics(self.worker.metrics.registry)
        # Background work that holds engine blocks (an abandoned pool load, a write-back):
        # referenced here until it ends, so that it is never garbage-collected mid-copy.
        self.background: set[asyncio.Future[Any]] = set()

    @property
    def engine(self) -> Any:
        self.worker.require_service()  # 503 while loading
        return self.worker.engine

    @property
    def fingerprint(self) -> str:
        return str(self.worker.health["fingerprint"])

    @property
    def block_size(self) -> int:
        return int(self.worker.health["block_size"])

    def require_pool(self) -> Any:
        if self.pool is None or not self.pool.is_open:
            raise unavailable("the KV pool client is not connected", "pool_unavailable", 2)
        return self.pool

    def wait_for_slots(self, num_slots: int, deadline_s: float) -> list[int]:
        """Staging slots within the bound, else 503 (a thread helper: it sleeps)."""
        pool = self.require_pool()
        delay_s = 0.002
        while True:
            slots = pool.slots.allocate(num_slots)
            if slots is not None:
                return slots
            if time.monotonic() + delay_s > deadline_s:
                raise unavailable(
                    f"no {num_slots} free staging slots within {self.settings.wait_s:.0f}s",
                    "staging_full",
                )
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.05)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None (work cancelled) if the caller disconnects first."""

    async def wait_disconnect() -> None:
        # The body is read already: the next message uvicorn delivers is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        return job.result() if job in done else None
    finally:
        for task in (job, watch):
            task.cancel()
        await asyncio.gather(job, watch, return_exceptions=True)


def _connect_pool(settings: PDSettings, engine: Any) -> Any:
    """The pool client; a GPU cache gets page-locked staging (or the worker does not start)."""
    from kernels.tensor_refs import describe_cache
    from workers.pool.client import KVPoolClient
    from workers.pool.client_config import PoolClientConfig

    cache = describe_cache(engine.kv_caches)
    config = PoolClientConfig(
        master_addr=settings.master_addr,
        metadata_url=settings.metadata_url,
        owner_addr=settings.owner_addr,
        local_hostname=settings.local_hostname,
        num_slots=settings.num_staging_slots,
        slot_bytes=cache.geometry.slot_bytes,
        page_lock=cache.on_gpu,
    )
    return KVPoolClient(config).connect()


def build_pd_app(
    cfg: WorkerConfig,
    on_failure: Callable[[BaseException], None],
    install_routes: Callable[[FastAPI, PDContext], None],
) -> FastAPI:
    """The mixed app of this role, plus the pool client and the role's routes."""
    from workers.engine.async_engine import AsyncEngine
    from workers.server.app import create_app

    settings = cfg.pd
    assert settings is not None, "WorkerConfig checks that P and D have pool settings"
    holder: dict[str, PDContext] = {}

    def engine_factory() -> Any:
        engine = AsyncEngine.from_config(cfg.engine)
        holder["ctx"].pool = _connect_pool(settings, engine)
        return engine

    @contextlib.asynccontextmanager
    async def pool_lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            ctx = holder["ctx"]
            if ctx.pool is not None:
                await asyncio.to_thread(ctx.pool.close)

    lifespans: list[Lifespan] = [pool_lifespan]
    describe = lambda: registration_body(holder["ctx"])  # noqa: E731
    # One registrar per router, each on its own: a router that is down delays no other.
    lifespans += [registration_lifespan(reg, describe) for reg in cfg.registration]
    app = create_app(cfg.app, engine_factory, on_failure, lifespans, cfg.internal_secret)
    ctx = PDContext(app, settings)
    holder["ctx"] = ctx
    install_routes(app, ctx)
    return app
