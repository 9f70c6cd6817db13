"""`pdrouter serve`: flags (generated from RouterConfig), the start-up fingerprint check, then
uvicorn.

The check runs before the server binds its port, so a cluster whose prefill and decode
instances disagree never serves a single request: the process exits 2 naming both instances.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

import httpx

from pdrouter.common.auth import internal_headers
from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import add_flags, from_args
from pdrouter.common.http_guard import guarded_protocol
from pdrouter.common.quiet_logs import quiet_health_checks
from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances import health
from pdrouter.router.instances.instance import FingerprintMismatch
from pdrouter.router.instances.registry import Registry

logger = logging.getLogger("pdrouter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdrouter serve`, one per flag()-marked field of RouterConfig."""
    add_flags(parser, RouterConfig)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's configuration; ConfigError (a usage error) for values that cannot work."""
    try:
        return from_args(RouterConfig, args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


async def _startup_check(registry: Registry, wait_s: float, secret: str | None) -> str | None:
    # The secret shows the workers' detailed /health (their fingerprint) when keyed.
    async with httpx.AsyncClient(headers=internal_headers(secret)) as client:
        return await health.startup(registry, client, wait_s)


# Objects allocated, less those freed, between two young-generation collections (CPython's
# default is 700). A request leaves about 30 objects that outlive it (its timeline among them,
# kept for GET /debug/requests/{id}) and no cyclic garbage, so at the
# default the collector ran every 20-25 requests and walked the young and middle generations
# each time: 10-40 us per request in benchmarks.router.path. At 10k it runs a tenth as often
# for 3-10 us per request; what it may leave uncollected meanwhile is at most 10k objects.
GC_YOUNG_THRESHOLD = 10_000


def settle_collector() -> None:
    """The garbage collector as the router serves with it, called once its app is built."""
    # Everything made so far (modules, the app, its schemas) lives as long as the process: out
    # of the collector's sight, a full collection walks only what came after (it walked about
    # 90k objects, 30 ms, every few thousand requests).
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = config_from_args(args)  # ConfigError: the CLI's usage error
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_health_checks(cfg.log_level)
    try:
        registry = Registry(list(cfg.prefill_urls), list(cfg.decode_urls), cfg.health)
        fingerprint = asyncio.run(_startup_check(registry, cfg.startup_wait_s, cfg.internal_secret))
    except (FingerprintMismatch, RuntimeError, ValueError) as exc:
        print(f"pdrouter: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    logger.info(
        "cluster fingerprint %s: %d prefill, %d decode instances",
        fingerprint,
        len(registry.prefill),
        len(registry.decode),
    )
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.admin_key is None:
        logger.warning(
            "listening on %s without --admin-key: anyone who reaches it may register or "
            "remove instances",
            cfg.host,
        )
    app = create_app(cfg, registry)
    settle_collector()
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level.lower(),
        timeout_graceful_shutdown=5,
        # Every OpenAI request logs one line of its own (id, tokens, timings, instances; the
        # status of a refused one), so uvicorn's access line would only repeat it, and it
        # costs the hot path even when its level filters it out. No X-Forwarded-For use
        # (nothing here reads client addresses) and no `server: uvicorn` header either.
        access_log=False,
        proxy_headers=False,
        server_header=False,
        http=guarded_protocol(cfg.head_limits),  # bounded request heads: 431 / 408
    )
    return 0
