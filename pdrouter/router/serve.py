"""`pdrouter serve`: flags, the start-up fingerprint check, then uvicorn.

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
from pdrouter.common.cli_args import add_flag
from pdrouter.common.http_guard import add_head_limit_flags, guarded_protocol, head_limits_from_args
from pdrouter.common.quiet_logs import quiet_health_checks
from pdrouter.router.app import create_app
from pdrouter.router.config import DEFAULTS, RouterConfig
from pdrouter.router.instances import health
from pdrouter.router.instances.instance import FingerprintMismatch, HealthThresholds
from pdrouter.router.instances.registry import Registry
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from pdrouter.router.selection.admission import AdmissionConfig
from pdrouter.router.selection.breaker import BreakerConfig
from pdrouter.router.selection.policies import POLICIES
from pdrouter.router.upstream.factory import UPSTREAM_CLIENTS

logger = logging.getLogger("pdrouter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--prefill",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill instance base URLs, e.g. http://127.0.0.1:8101 (none: workers "
        "register themselves with `pdworker serve --router URL`)",
    )
    add_flag(
        parser,
        "--decode",
        nargs="*",
        default=[],
        metavar="URL",
        help="decode instance base URLs (give both --prefill and --decode, or neither)",
    )
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind")
    add_flag(parser, "--port", type=int, default=8000, help="port to serve on")
    add_flag(
        parser,
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and every other path but /health, "
        "and the admin key on /metrics and the API docs (none: open); set it through "
        "PDROUTER_API_KEY: argv is public (docs/security.md)",
    )
    add_flag(
        parser,
        "--prefill-policy",
        default=DEFAULTS.prefill_policy,
        choices=sorted(POLICIES),
        help="how a prefill instance is chosen",
    )
    add_flag(
        parser,
        "--decode-policy",
        default=DEFAULTS.decode_policy,
        choices=sorted(POLICIES),
        help="how a decode instance is chosen",
    )
    add_flag(
        parser,
        "--missing-kv-policy",
        default=None,
        choices=["recompute", "fail"],
        help="what decode does when pool blocks are missing (none: each decode "
        "instance's own default)",
    )
    add_flag(
        parser,
        "--connect-timeout-s",
        type=float,
        default=DEFAULTS.orchestrator.timeouts.connect_s,
        help="connect timeout of every call to a worker",
    )
    add_flag(
        parser,
        "--prefill-timeout-s",
        type=float,
        default=DEFAULTS.orchestrator.timeouts.prefill_s,
        help="bound on a prefill answer (queue + compute + pool write)",
    )
    add_flag(
        parser,
        "--decode-timeout-s",
        type=float,
        default=DEFAULTS.orchestrator.timeouts.decode_event_s,
        help="bound on the gap between two events of a decode stream",
    )
    add_flag(
        parser,
        "--max-prefill-attempts",
        type=int,
        default=DEFAULTS.orchestrator.max_prefill_attempts,
        help="prefill instances tried per request before giving up",
    )
    add_flag(
        parser,
        "--max-decode-attempts",
        type=int,
        default=DEFAULTS.orchestrator.max_decode_attempts,
        help="decode instances tried per request (unreachable or died mid-stream)",
    )
    add_flag(
        parser,
        "--health-interval-s",
        type=float,
        default=DEFAULTS.health_interval_s,
        help="period of the /health checks of every instance",
    )
    add_flag(
        parser,
        "--startup-wait-s",
        type=float,
        default=DEFAULTS.startup_wait_s,
        help="how long to wait at start for every instance to answer /health",
    )
    add_instance_arguments(parser)
    add_flag(
        parser,
        "--upstream-client",
        default=DEFAULTS.upstream_client,
        choices=list(UPSTREAM_CLIENTS),
        help="HTTP client for calls to workers: h1 (our own HTTP/1.1 client on httptools: "
        "half aiohttp's time per call), aiohttp (about half httpx's CPU per request), httpx; "
        "auto: h1",
    )
    add_flag(
        parser,
        "--max-body-bytes",
        type=int,
        default=DEFAULTS.max_body_bytes,
        help="largest request body the OpenAI routes accept; a longer one is refused with 413 "
        "(default: derived from the served context length, max_model_len x "
        "--max-bytes-per-token + 64 KiB, a longer one refused with 400 "
        "context_length_exceeded before any worker is touched)",
    )
    add_flag(
        parser,
        "--max-bytes-per-token",
        type=int,
        default=DEFAULTS.max_bytes_per_token,
        help="bytes of request body allowed per token of context when --max-body-bytes is not "
        "given (a generous bound on a token's length in text)",
    )
    add_head_limit_flags(parser, DEFAULTS.head_limits)
    add_flag(parser, "--log-level", default="info", help="python logging level")


def add_instance_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of registration, health thresholds and the keys (pdrouter.common.auth)."""
    add_flag(
        parser,
        "--admin-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /instances* and /debug/* (and, with "
        "--api-key, /metrics, the API docs and the detailed /health); none: open, or closed "
        "when --api-key is set. Set it through PDROUTER_ADMIN_KEY: argv is public",
    )
    add_flag(
        parser,
        "--internal-secret",
        default=None,
        help="shared secret sent to workers on every hop (X-PD-Internal-Secret); workers "
        "started with the same --internal-secret refuse /internal/* without it",
    )
    add_flag(
        parser,
        "--unhealthy-after",
        type=int,
        default=DEFAULTS.health.unhealthy_after,
        help="failed health checks in a row before an instance leaves the rotation (a "
        "failed connection takes it out at once)",
    )
    add_flag(
        parser,
        "--abandon-after-s",
        type=float,
        default=DEFAULTS.health.abandon_after_s,
        help="a call to an instance its health checks find down is given up (retried or "
        "resumed elsewhere) once it has had nothing from the instance for this long",
    )
    add_flag(
        parser,
        "--healthy-after",
        type=int,
        default=DEFAULTS.health.healthy_after,
        help="passed health checks in a row before a down instance is back in the rotation",
    )
    add_flag(
        parser,
        "--heartbeat-ttl-s",
        type=float,
        default=DEFAULTS.heartbeat_ttl_s,
        help="a self-registered instance silent this long is removed",
    )
    add_flag(
        parser,
        "--max-in-flight",
        type=int,
        default=None,
        help="client requests served at once; beyond it 429 with Retry-After (none: no cap)",
    )
    add_flag(
        parser,
        "--max-in-flight-per-instance",
        type=int,
        default=None,
        help="calls one prefill or decode instance gets at once; when every instance is at "
        "it, 429 with Retry-After (none: no cap)",
    )
    add_flag(
        parser,
        "--breaker-failures",
        type=int,
        default=DEFAULTS.breaker.failure_threshold,
        help="consecutive transport errors or 5xx answers that open an instance's circuit "
        "breaker (4xx never count)",
    )
    add_flag(
        parser,
        "--breaker-cooldown-s",
        type=float,
        default=DEFAULTS.breaker.cooldown_s,
        help="how long an open breaker skips its instance before it lets trial calls through "
        "(a passed health check ends it sooner)",
    )
    add_flag(
        parser,
        "--breaker-half-open-calls",
        type=int,
        default=DEFAULTS.breaker.half_open_calls,
        help="trial calls a half-open breaker lets through at once; the first that succeeds "
        "closes it",
    )
    add_flag(
        parser,
        "--breaker-trial-wait-s",
        type=float,
        default=DEFAULTS.breaker.trial_wait_s,
        help="how long a request waits for a trial slot of a half-open breaker before 503",
    )
    add_flag(
        parser,
        "--timeline-capacity",
        type=int,
        default=DEFAULTS.timeline_capacity,
        help="recent requests whose timeline GET /debug/requests/{id} keeps",
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    timeouts = HopTimeouts(
        connect_s=args.connect_timeout_s,
        prefill_s=args.prefill_timeout_s,
        decode_event_s=args.decode_timeout_s,
    )
    return RouterConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        orchestrator=OrchestratorConfig(
            timeouts=timeouts,
            max_prefill_attempts=args.max_prefill_attempts,
            max_decode_attempts=args.max_decode_attempts,
            missing_kv_policy=args.missing_kv_policy,
        ),
        health_interval_s=args.health_interval_s,
        startup_wait_s=args.startup_wait_s,
        api_key=args.api_key,
        admin_key=args.admin_key,
        internal_secret=args.internal_secret,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        admission=AdmissionConfig(
            max_in_flight=args.max_in_flight,
            max_in_flight_per_instance=args.max_in_flight_per_instance,
        ),
        breaker=BreakerConfig(
            args.breaker_failures,
            args.breaker_cooldown_s,
            args.breaker_half_open_calls,
            args.breaker_trial_wait_s,
        ),
        health=HealthThresholds(args.unhealthy_after, args.healthy_after, args.abandon_after_s),
        timeline_capacity=args.timeline_capacity,
        upstream_client=args.upstream_client,
        max_body_bytes=args.max_body_bytes,
        max_bytes_per_token=args.max_bytes_per_token,
        head_limits=head_limits_from_args(args),
    )


async def _startup_check(registry: Registry, wait_s: float, secret: str | None) -> str | None:
    # The secret shows the workers' detailed /health (their fingerprint) when keyed.
    async with httpx.AsyncClient(headers=internal_headers(secret)) as client:
        return await health.startup(registry, client, wait_s)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_health_checks(args.log_level)
    try:
        cfg = config_from_args(args)
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
    if args.host not in ("127.0.0.1", "localhost", "::1") and cfg.admin_key is None:
        logger.warning(
            "listening on %s without --admin-key: anyone who reaches it may register or "
            "remove instances",
            args.host,
        )
    app = create_app(cfg, registry)
    # Everything made so far (modules, the app, its schemas) lives as long as the process: out
    # of the collector's sight, a full collection walks only what came after (it walked about
    # 90k objects, 30 ms, every few thousand requests).
    gc.freeze()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
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
