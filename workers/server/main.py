"""`pdworker serve`: flags (each with a PDWORKER_* environment mirror), config, uvicorn.

    pdworker serve --role mixed --model tiny --port 8100

WorkerConfig (config.py) is built here once, from the parsed flags, and passed down: the
engine gets an EngineConfig, the HTTP layer an AppConfig, P and D their PDSettings and the
registrar its RegistrationConfig. The flags are generated from those dataclasses' fields
(pdrouter.common.flags), defaults included. A role's
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

from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import add_flags, from_args, value_of
from pdrouter.common.http_guard import guarded_protocol
from pdrouter.common.quiet_logs import quiet_health_checks
from workers.engine.engine_config import EngineConfig
from workers.server.config import (
    AppConfig,
    PDSettings,
    RegistrationConfig,
    WorkerConfig,
    advertise_url_of,
)

RoleBuilder = Callable[[WorkerConfig, Callable[[BaseException], None]], Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdworker serve`, one per flag()-marked field of WorkerConfig."""
    add_flags(parser, WorkerConfig)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's whole configuration; ConfigError (a usage error) for what cannot work.

    Built from the flags field by field, but for what several flags decide together: the
    served names (the model's by default), the pool settings (only for a P/D role given
    --master and --metadata) and one registration per --router URL."""
    try:
        engine = from_args(EngineConfig, args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    role = value_of(WorkerConfig, "role", args)
    pd = None
    if role != "mixed" and args.master and args.metadata:
        pd = from_args(PDSettings, args)
    registration: tuple[RegistrationConfig, ...] = ()
    routers = value_of(RegistrationConfig, "router_url", args)
    if routers and role != "mixed":
        given = value_of(RegistrationConfig, "advertise_url", args)
        host, port = value_of(WorkerConfig, "host", args), value_of(WorkerConfig, "port", args)
        advertise_url = advertise_url_of(host, port, given)
        registration = tuple(
            from_args(RegistrationConfig, args, router_url=url, advertise_url=advertise_url)
            for url in dict.fromkeys(url.rstrip("/") for url in routers)  # once each
        )
    names = value_of(AppConfig, "served_model_names", args) or (engine.model,)
    app = from_args(AppConfig, args, role=role, served_model_names=names)
    return from_args(WorkerConfig, args, app=app, engine=engine, pd=pd, registration=registration)


def build_mixed_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> Any:
    """The mixed (colocated) worker: the OpenAI API over a local engine."""
    from workers.engine.async_engine import AsyncEngine
    from workers.server.app import create_app

    engine_factory = lambda: AsyncEngine.from_config(cfg.engine)  # noqa: E731
    return create_app(
        cfg.app,
        engine_factory,
        on_failure,
        internal_secret=cfg.internal_secret,
        router_only=cfg.router_only,
    )


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
