"""The flags of the prefill and decode roles and of self-registration (`pdworker serve`).

Defaults come from PDSettings and RegistrationConfig (workers/server/config.py), written there
once; main.py adds these flags and builds the configs from them.
"""

from __future__ import annotations

import argparse

from pdrouter.common.cli_args import add_flag
from workers.server.config import PDSettings, RegistrationConfig

_PD = PDSettings(master_addr="", metadata_url="")
_REG = RegistrationConfig(router_url="", advertise_url="")


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the prefill and decode roles (ignored by the mixed role)."""
    add_flag(
        parser,
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="Mooncake master address (roles prefill and decode)",
    )
    add_flag(
        parser,
        "--metadata",
        default=None,
        metavar="URL",
        help="Mooncake metadata URL, e.g. http://127.0.0.1:PORT/metadata",
    )
    add_flag(
        parser,
        "--pool-owner",
        default=None,
        metavar="HOST:PORT",
        help="same-host shared-memory pool owner (its mooncake_client); none: TCP",
    )
    add_flag(
        parser,
        "--pool-hostname",
        default=_PD.local_hostname,
        metavar="ADDRESS",
        help="this host's address as Mooncake advertises it to the pool (TCP): the pool "
        "owners on other hosts must reach it",
    )
    add_flag(
        parser,
        "--staging-slots",
        type=int,
        default=_PD.num_staging_slots,
        help="KV blocks the host staging buffer holds (concurrent requests share it)",
    )
    add_flag(
        parser,
        "--transfer-batch-blocks",
        type=int,
        default=_PD.transfer_batch_blocks,
        help="most blocks moved per swap + pool call (at most --staging-slots)",
    )
    add_flag(
        parser,
        "--pool-wait-s",
        type=float,
        default=_PD.wait_s,
        help="bound on waiting for free staging slots or KV blocks",
    )
    add_flag(
        parser,
        "--missing-kv-policy",
        default=_PD.missing_kv_policy,
        choices=["recompute", "fail"],
        help="decode: recompute blocks missing from the pool, or answer 502",
    )
    add_flag(
        parser,
        "--no-write-while-computing",
        action="store_true",
        help="prefill: write a prompt's blocks only once its whole prefill is done (default: "
        "the blocks of each finished chunk are written while the next chunk computes)",
    )
    add_flag(
        parser,
        "--no-pool-prefix-cache",
        action="store_true",
        help="prefill: never read a prompt's prefix from the pool (compute what the device "
        "cache lacks)",
    )
    add_flag(
        parser,
        "--pool-prefix-min-tokens",
        type=int,
        default=_PD.pool_prefix_min_tokens,
        help="prefill: smallest pool hit (tokens) worth loading",
    )
    add_flag(
        parser,
        "--pool-load-timeout-s",
        type=float,
        default=_PD.pool_load_timeout_s,
        help="prefill: bound on a pool prefix load; past it the request recomputes",
    )
    add_flag(
        parser,
        "--no-decode-writeback",
        action="store_true",
        help="decode: do not write prompt + output blocks back to the pool when a request ends",
    )
    add_flag(
        parser,
        "--writeback-max-in-flight",
        type=int,
        default=_PD.writeback_max_in_flight,
        help="decode: most write-backs running at once (more are skipped)",
    )


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of self-registration with a router and of the internal secret."""
    add_flag(
        parser,
        "--router",
        action="append",
        default=None,
        metavar="URL",
        help="router to register with once ready (roles prefill and decode); "
        "heartbeats, and deregisters on a clean shutdown. Give it once per router (the "
        "environment mirror takes a comma-separated list): each is kept independently",
    )
    add_flag(
        parser,
        "--advertise-url",
        default=None,
        metavar="URL",
        help="how the router reaches this worker (default: http://HOST:PORT)",
    )
    add_flag(
        parser,
        "--admin-key",
        default=None,
        help="the router's admin key: sent when registering, and accepted by this worker's "
        "/metrics and detailed /health (set it through PDWORKER_ADMIN_KEY: argv is public)",
    )
    add_flag(
        parser,
        "--api-key",
        default=None,
        help="client API key: with it, /v1/* need it (or the internal secret) and every path "
        "but /health is locked (set it through PDWORKER_API_KEY: argv is public)",
    )
    add_flag(
        parser,
        "--heartbeat-interval-s",
        type=float,
        default=_REG.heartbeat_interval_s,
        help="seconds between heartbeats to --router (at most a third of its TTL)",
    )
    add_flag(
        parser,
        "--internal-secret",
        default=None,
        help="shared secret /internal/* require in X-PD-Internal-Secret (the router's "
        "--internal-secret); none: open (bind loopback)",
    )
