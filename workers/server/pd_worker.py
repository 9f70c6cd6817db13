"""What the prefill and decode roles share: the seam (PDSeam), metrics, the app shell.

A PD worker is the mixed worker's app (same /health, /metrics, /v1/*, engine loading) plus one
internal endpoint and a KVPoolClient. The pool client connects in the engine-loading thread,
after the engine exists (its staging slot size is one block of every layer of this engine's
cache), so /health turns 200 only when both are ready:

    create_app(attach=PDRole.attach)     port open, /health 503 loading
      loading thread: engine, identity, attach -> pool client -> PDSeam (frozen)
      engine.start(), service               /health 200, registration starts
    handler: role.seam() -> PDSeam          503 while loading or once the engine died
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel

from pdrouter.wire.errors import bad_request, unavailable
from pdrouter.wire.worker import WorkerIdentity
from workers.server.app import Lifespan, WorkerState
from workers.server.cache_metrics import CacheMetrics
from workers.server.config import PDSettings, WorkerConfig
from workers.server.cpu_work import CpuWork
from workers.server.metrics import ServerMetrics
from workers.server.registration import registration_lifespan
from workers.server.trace_spans import make_worker_tracer

if TYPE_CHECKING:
    from workers.engine.async_engine import AsyncEngine
    from workers.pool.checked_pool import CheckedPool
    from workers.pool.client import KVPoolClient
    from workers.pool.device_pool import DevicePool
    from workers.pool.handoff_path import HandoffPath

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
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
        self.handoff_path = Gauge(
            "pdworker_handoff_path",
            "1 for the way the handoff goes through the pool, chosen at start (host staging "
            "or device pointers; /health says why)",
            ["path"],
            registry=registry,
        )
        self.handoff_fallbacks = Counter(
            "pdworker_handoff_fallbacks",
            "device-pointer pool calls that failed twice and were redone through host staging",
            ["op", "reason"],
            registry=registry,
        )

        self.integrity_failures = Counter(
            "pdworker_pool_integrity_failures",
            "pool objects read whose header did not prove their content (removed, recomputed)",
            ["reason"],
            registry=registry,
        )

    def count_integrity_failure(self, reason: str) -> None:
        self.integrity_failures.labels(reason=reason).inc()

    def count_fallback(self, op: str, reason: str) -> None:
        self.handoff_fallbacks.labels(op=op, reason=reason).inc()

    def show_path(self, name: str) -> None:
        for path in ("host", "device"):
            self.handoff_path.labels(path=path).set(1 if path == name else 0)


@dataclass(frozen=True)
class PDSeam:
    """Everything a prefill or decode handler uses, built once after the engine and the pool
    client have loaded (PDRole.attach); a test builds the same object over the numpy runner
    and the fault pool.

    The engine's block and lease calls are coroutines or posts (never the engine lock on
    the event loop); background holds work that still uses engine blocks after its request
    has answered (an abandoned pool load, a write-back), so it is never collected mid-copy.
    """

    engine: AsyncEngine
    # the handoff's pool: the client, or device staging over it; checked unless --pool-integrity off
    pool: KVPoolClient | DevicePool | CheckedPool
    settings: PDSettings
    identity: WorkerIdentity
    metrics: PDMetrics
    cache_metrics: CacheMetrics
    server_metrics: ServerMetrics
    cpu: CpuWork
    background: set[asyncio.Future[Any]] = field(default_factory=set)

    def open_pool(self) -> KVPoolClient:
        """The pool client, or 503 pool_unavailable once it has closed (shutting down)."""
        if not self.pool.is_open:
            raise unavailable("the KV pool client is not connected", "pool_unavailable", 2)
        return self.pool


class PDRole:
    """The P/D part of a worker app: its metrics from the start, its seam once loaded."""

    def __init__(self, worker: WorkerState, settings: PDSettings) -> None:
        self.worker = worker
        self.settings = settings
        self.metrics = PDMetrics(worker.metrics.registry)
        self.cache_metrics = CacheMetrics(worker.metrics.registry)
        self.background: set[asyncio.Future[Any]] = set()  # see PDSeam
        self._seam: PDSeam | None = None

    def attach(self, engine: AsyncEngine, identity: WorkerIdentity) -> WorkerIdentity:
        """In the loading thread, after the engine exists: the pool client (its staging slot
        is one block of every layer of this engine's cache), the handoff path over it, and
        the seam over both; returns the identity with the path (/health, registration)."""
        path = _connect_pool(self.settings, engine, self.worker.metrics.registry, self.metrics)
        identity = dataclasses.replace(
            identity, handoff_path=path.name, handoff_path_reason=path.reason
        )
        self._seam = PDSeam(
            engine=engine,
            pool=path.pool,
            settings=self.settings,
            identity=identity,
            metrics=self.metrics,
            cache_metrics=self.cache_metrics,
            server_metrics=self.worker.metrics,
            cpu=self.worker.cpu,
            background=self.background,
        )
        self.worker.dependencies.append(functools.partial(_pool_problem, self._seam.pool))
        return identity

    def seam(self) -> PDSeam:
        """The seam of a worker that serves, else 503 (loading, or the engine died)."""
        self.worker.require_service()
        assert self._seam is not None, "the service starts only after attach() built the seam"
        return self._seam

    def registration(self) -> WorkerIdentity | None:
        """The identity to register with once the worker serves (engine and pool), else None."""
        if self.worker.service is None or self._seam is None:
            return None
        return self._seam.identity

    async def close(self) -> None:
        if self._seam is not None:
            await asyncio.to_thread(self._seam.pool.close)


async def read_message(request: Request, message: type[M], what: str) -> M:
    """The body parsed as one of the P/D messages, or a 400 naming what was malformed."""
    try:
        return message.model_validate_json(await request.body())
    except ValueError as exc:
        raise bad_request(f"malformed {what}: {exc}") from None


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


def _pool_problem(pool: KVPoolClient | DevicePool) -> str | None:
    """Why the pool client cannot serve the handoff now (reconnecting), or None."""
    health = pool.health()
    return None if health.ok else f"kv pool: {health.reason}"


def _connect_pool(
    settings: PDSettings, engine: AsyncEngine, registry: Any, metrics: PDMetrics
) -> HandoffPath:
    """The pool client and the handoff path over it (workers/pool/handoff_path.py). A GPU
    cache gets page-locked host staging (or the worker does not start) and its GPU current on
    the client's call threads. The client's health (degraded while it reconnects) and
    reconnections go on the worker's registry, the path and its fallbacks on metrics."""
    from kernels.tensor_refs import describe_cache
    from workers.pool.client import KVPoolClient
    from workers.pool.client_config import PoolClientConfig
    from workers.pool.handoff_path import choose_handoff_path

    cache = describe_cache(engine.kv_caches)
    device_id = None
    if cache.on_gpu:
        from kernels.cuda_swap import device_of_cache, import_cupy

        device_id = device_of_cache(import_cupy(), cache)
    config = PoolClientConfig(
        master_addr=settings.master_addr,
        metadata_url=settings.metadata_url,
        owner_addr=settings.owner_addr,
        local_hostname=settings.local_hostname,
        num_slots=settings.num_staging_slots,
        # A slot holds a block of every KV head: any rank's shard, any writer's (TP sizes).
        slot_bytes=cache.geometry.slot_bytes * engine.engine_config.tensor_parallel_size,
        page_lock=cache.on_gpu,
        cuda_device=device_id,
    )
    client = KVPoolClient(config, registry=registry).connect()
    try:
        path = choose_handoff_path(
            settings.handoff_path, client, device_id, on_fallback=metrics.count_fallback
        )
    except BaseException:
        client.close()
        raise
    metrics.show_path(path.name)
    pool = path.pool
    if settings.pool_integrity == "on":  # each shard object proves its content
        from workers.pool.checked_pool import CheckedPool

        pool = CheckedPool(pool, cache.geometry.block_size, metrics.count_integrity_failure)
    from workers.engine.tp.sharded_pool import sharded_pool

    try:
        pool = sharded_pool(engine, pool, config, path.name)
        return dataclasses.replace(path, pool=pool)
    except BaseException:
        client.close()
        raise


def build_pd_app(
    cfg: WorkerConfig,
    on_failure: Callable[[BaseException], None],
    install_routes: Callable[[FastAPI, PDRole], None],
) -> FastAPI:
    """The mixed app of this role, plus the pool client and the role's routes."""
    from workers.engine.async_engine import AsyncEngine
    from workers.server.app import create_app

    settings = cfg.pd
    assert settings is not None, "WorkerConfig checks that P and D have pool settings"

    @contextlib.asynccontextmanager
    async def pool_lifespan(app_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await role_of(app_).close()

    lifespans: list[Lifespan] = [pool_lifespan]
    # One registrar per router, each on its own: a router that is down delays no other.
    lifespans += [
        registration_lifespan(reg, cfg.app.max_pending_requests, _ready_identity)
        for reg in cfg.registration
    ]
    role: PDRole | None = None

    def attach(engine: AsyncEngine, identity: WorkerIdentity) -> WorkerIdentity:
        assert role is not None, "the app (and its role) exist before the engine loads"
        return role.attach(engine, identity)

    app = create_app(
        cfg.app,
        lambda: AsyncEngine.from_config(cfg.engine),
        on_failure,
        lifespans,
        cfg.internal_secret,
        attach,
        router_only=cfg.router_only,
    )
    role = PDRole(app.state.worker, settings)
    app.state.pd_role = role
    app.state.tracer = make_worker_tracer(cfg.tracing, cfg.role, f"http://{cfg.host}:{cfg.port}")
    install_routes(app, role)
    return app


def _ready_identity(app: FastAPI) -> Callable[[], WorkerIdentity | None]:
    return role_of(app).registration


def role_of(app: FastAPI) -> PDRole:
    role = app.state.pd_role
    assert isinstance(role, PDRole), "build_pd_app sets app.state.pd_role"
    return role
