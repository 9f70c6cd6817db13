"""`pdworker serve`: flags (each with a PDROUTER_* environment mirror) and the uvicorn entry.

    pdworker serve --role mixed --model tiny --port 8100

Config is built here once, from the parsed flags, and passed down: the engine gets an
EngineConfig, the HTTP layer an AppConfig. ROLE_BUILDERS maps each role to the function that
builds its app: mixed here, prefill and decode in workers/prefill/worker.py and decode.py.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pdrouter.common.cli_args import add_flag

ROLES = ("mixed", "prefill", "decode")
RoleBuilder = Callable[[argparse.Namespace, Callable[[BaseException], None]], Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdworker serve`."""
    add_flag(parser, "--role", choices=ROLES, default="mixed", help="what this worker serves")
    add_flag(
        parser,
        "--model",
        default="tiny",
        help="'tiny' (built-in test model), 'demo' (packaged trained model) or a Hugging Face "
        "checkpoint folder",
    )
    add_flag(
        parser,
        "--model-cache-dir",
        default=None,
        help="where built-in tiny checkpoints are materialized (default: ~/.cache/pdrouter)",
    )
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind")
    add_flag(parser, "--port", type=int, default=8100, help="HTTP port")
    add_flag(
        parser,
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients must send (default: the --model value)",
    )
    add_flag(parser, "--dtype", default="float32", help="weights and KV cache dtype")
    add_flag(parser, "--device", default="cpu", help="'cpu' or 'gpu' / 'gpu:N'")
    add_flag(
        parser, "--seed", type=int, default=0, help="seed of the built-in tiny model's weights"
    )
    add_flag(parser, "--block-size", type=int, default=None, help="tokens per KV block")
    add_flag(parser, "--num-kv-blocks", type=int, default=None, help="KV blocks in the cache")
    add_flag(
        parser, "--max-num-seqs", type=int, default=None, help="most requests in one running batch"
    )
    add_flag(
        parser,
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens computed in one engine step (prefill chunk budget)",
    )
    add_flag(
        parser,
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt + completion tokens (default: the model's)",
    )
    add_flag(
        parser,
        "--max-pending-requests",
        type=int,
        default=256,
        help="requests held at once (running + queued); beyond it 503 + Retry-After",
    )
    add_flag(parser, "--log-level", default="info", help="debug, info, warning or error")
    from workers.server.pd_worker import add_pd_arguments

    add_pd_arguments(parser)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """EngineConfig from the flags; flags left unset keep the engine's defaults."""
    from workers.engine.engine_config import EngineConfig

    optional = {
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    given = {k: v for k, v in optional.items() if v is not None}
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        device=args.device,
        cache_dir=args.model_cache_dir,
        **given,
    )


def build_mixed_app(args: argparse.Namespace, on_failure: Callable[[BaseException], None]) -> Any:
    """The mixed (colocated) worker: the OpenAI API over a local engine."""
    from workers.engine.async_engine import AsyncEngine
    from workers.server.app import AppConfig, create_app

    engine_cfg = engine_config_from_args(args)
    app_cfg = AppConfig(
        role="mixed",
        served_model_names=tuple(args.served_model_name or [args.model]),
        max_pending_requests=args.max_pending_requests,
    )
    return create_app(app_cfg, lambda: AsyncEngine.from_config(engine_cfg), on_failure)


def _lazy_builder(module_name: str, function_name: str) -> RoleBuilder:
    # The PD roles import the Mooncake pool client: only load them when that role is asked for.
    def build(args: argparse.Namespace, on_failure: Callable[[BaseException], None]) -> Any:
        import importlib

        builder = getattr(importlib.import_module(module_name), function_name)
        return builder(args, on_failure)

    return build


ROLE_BUILDERS: Mapping[str, RoleBuilder] = MappingProxyType(
    {
        "mixed": build_mixed_app,
        "prefill": _lazy_builder("workers.prefill.worker", "build_prefill_app"),
        "decode": _lazy_builder("workers.decode.worker", "build_decode_app"),
    }
)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 1 if the engine failed to load, 2 for an unknown role."""
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    builder = ROLE_BUILDERS.get(args.role)
    if builder is None:
        logging.getLogger(__name__).error(
            "role %r is not available in this build (available: %s)",
            args.role,
            ", ".join(sorted(ROLE_BUILDERS)),
        )
        return 2
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app = builder(args, on_failure)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
        # The router drops idle upstream connections after 4 s; keeping ours open far longer
        # means the router never sends on a connection this server is closing.
        timeout_keep_alive=30,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if failures else 0
