"""`pdworker serve`: flags (each with a PDWORKER_* environment mirror), config, uvicorn.

    pdworker serve --role mixed --model tiny --port 8100

WorkerConfig (config.py) is built here once, from the parsed flags, and passed down: the
engine gets an EngineConfig, the HTTP layer an AppConfig, P and D their PDSettings and the
registrar its RegistrationConfig. Flags take their defaults from those dataclasses. A role's
app is built by ROLE_BUILDERS: mixed here, prefill and decode in workers/prefill and
workers/decode (imported only for that role: they load the Mooncake client).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pdrouter.common.cli_args import ConfigError, add_flag
from pdrouter.common.http_guard import add_head_limit_flags, guarded_protocol, head_limits_from_args
from pdrouter.common.quiet_logs import quiet_health_checks
from workers.engine.engine_config import EngineConfig
from workers.server.config import (
    ROLES,
    AppConfig,
    PDSettings,
    RegistrationConfig,
    WorkerConfig,
    advertise_url_of,
)
from workers.server.pd_arguments import add_pd_arguments, add_registration_arguments

RoleBuilder = Callable[[WorkerConfig, Callable[[BaseException], None]], Any]
_APP = AppConfig(role="mixed", served_model_names=())
_ENGINE = EngineConfig()
_WORKER = WorkerConfig(role="mixed", app=_APP, engine=_ENGINE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdworker serve`."""
    add_flag(parser, "--role", choices=ROLES, default="mixed", help="what this worker serves")
    add_flag(
        parser,
        "--model",
        default=_ENGINE.model,
        help="'tiny' (built-in test model), 'demo' (packaged trained model) or a Hugging Face "
        "checkpoint folder",
    )
    add_flag(
        parser,
        "--model-cache-dir",
        default=None,
        help="where built-in tiny checkpoints are materialized (default: ~/.cache/pdrouter)",
    )
    add_flag(parser, "--host", default=_WORKER.host, help="address to bind")
    add_flag(parser, "--port", type=int, default=_WORKER.port, help="HTTP port")
    add_flag(
        parser,
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients must send (default: the --model value)",
    )
    add_flag(parser, "--dtype", default=_ENGINE.dtype, help="weights and KV cache dtype")
    add_flag(parser, "--device", default=_ENGINE.device, help="'cpu' or 'gpu' / 'gpu:N'")
    add_flag(
        parser,
        "--seed",
        type=int,
        default=_ENGINE.seed,
        help="seed of the built-in tiny model's weights",
    )
    add_flag(
        parser, "--block-size", type=int, default=_ENGINE.block_size, help="tokens per KV block"
    )
    add_flag(
        parser,
        "--num-kv-blocks",
        type=int,
        default=_ENGINE.num_kv_blocks,
        help="KV blocks in the cache",
    )
    add_flag(
        parser,
        "--max-num-seqs",
        type=int,
        default=_ENGINE.max_num_seqs,
        help="most requests in one running batch",
    )
    add_flag(
        parser,
        "--max-num-batched-tokens",
        type=int,
        default=_ENGINE.max_num_batched_tokens,
        help="most tokens computed in one engine step (prefill chunk budget)",
    )
    add_flag(
        parser,
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt + completion tokens (default: the model's, capped "
        "by the KV cache)",
    )
    add_flag(
        parser,
        "--no-prefix-cache",
        action="store_true",
        help="turn the device prefix cache off: every prompt block is computed (the "
        "reference for correctness tests and benchmarks)",
    )
    add_flag(
        parser,
        "--max-pending-requests",
        type=int,
        default=_APP.max_pending_requests,
        help="requests held at once (running + queued); past it 503 + Retry-After",
    )
    add_flag(
        parser,
        "--max-body-bytes",
        type=int,
        default=_APP.max_body_bytes,
        help="largest request body accepted; a longer one is refused with 413 (default: "
        "derived from the context length, max_model_len x 80 + 64 KiB, a longer body refused "
        "with 400 context_length_exceeded before anything tokenizes it)",
    )
    add_flag(parser, "--log-level", default=_WORKER.log_level, help="debug, info, warning or error")
    add_head_limit_flags(parser, _WORKER.head_limits)
    add_pd_arguments(parser)
    add_registration_arguments(parser)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's whole configuration; ConfigError (a usage error) for what cannot work."""
    try:
        engine = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            seed=args.seed,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            device=args.device,
            cache_dir=args.model_cache_dir,
            enable_prefix_cache=not args.no_prefix_cache,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    pd = None
    if args.role != "mixed" and args.master and args.metadata:
        pd = PDSettings(
            master_addr=args.master,
            metadata_url=args.metadata,
            owner_addr=args.pool_owner,
            local_hostname=args.pool_hostname,
            num_staging_slots=args.staging_slots,
            transfer_batch_blocks=args.transfer_batch_blocks,
            wait_s=args.pool_wait_s,
            missing_kv_policy=args.missing_kv_policy,
            write_while_computing=not args.no_write_while_computing,
            pool_prefix=not args.no_pool_prefix_cache,
            pool_prefix_min_tokens=args.pool_prefix_min_tokens,
            pool_load_timeout_s=args.pool_load_timeout_s,
            writeback=not args.no_decode_writeback,
            writeback_max_in_flight=args.writeback_max_in_flight,
        )
    registration: tuple[RegistrationConfig, ...] = ()
    if args.router and args.role != "mixed":
        advertise_url = advertise_url_of(args.host, args.port, args.advertise_url)
        routers = list(dict.fromkeys(url.rstrip("/") for url in args.router))  # once each
        registration = tuple(
            RegistrationConfig(
                router_url=url,
                advertise_url=advertise_url,
                admin_key=args.admin_key,
                heartbeat_interval_s=args.heartbeat_interval_s,
            )
            for url in routers
        )
    return WorkerConfig(
        role=args.role,
        app=AppConfig(
            role=args.role,
            served_model_names=tuple(args.served_model_name or [args.model]),
            max_pending_requests=args.max_pending_requests,
            max_body_bytes=args.max_body_bytes,
            api_key=args.api_key,
            admin_key=args.admin_key,
        ),
        engine=engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        pd=pd,
        registration=registration,
        internal_secret=args.internal_secret,
        head_limits=head_limits_from_args(args),
    )


def build_mixed_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> Any:
    """The mixed (colocated) worker: the OpenAI API over a local engine."""
    from workers.engine.async_engine import AsyncEngine
    from workers.server.app import create_app

    engine_factory = lambda: AsyncEngine.from_config(cfg.engine)  # noqa: E731
    return create_app(cfg.app, engine_factory, on_failure, internal_secret=cfg.internal_secret)


def _lazy_builder(module_name: str, function_name: str) -> RoleBuilder:
    # The PD roles import the Mooncake pool client: only load them when that role is asked for.
    def build(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> Any:
        builder = getattr(importlib.import_module(module_name), function_name)
        return builder(cfg, on_failure)

    return build


ROLE_BUILDERS: Mapping[str, RoleBuilder] = MappingProxyType(
    {
        "mixed": build_mixed_app,
        "prefill": _lazy_builder("workers.prefill.worker", "build_prefill_app"),
        "decode": _lazy_builder("workers.decode.worker", "build_decode_app"),
    }
)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 1 if the engine failed to load."""
    import uvicorn

    cfg = config_from_args(args)  # ConfigError: the CLI's usage error, before slow imports
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    quiet_health_checks(cfg.log_level)
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app = ROLE_BUILDERS[cfg.role](cfg, on_failure)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level.lower(),
        timeout_graceful_shutdown=5,
        # The router drops idle upstream connections after 4 s; keeping ours open far longer
        # means the router never sends on a connection this server is closing.
        timeout_keep_alive=30,
        lifespan="on",
        http=guarded_protocol(cfg.head_limits),  # bounded request heads: 431 / 408
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if failures else 0
