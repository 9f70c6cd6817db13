"""`pdworker master`: the Mooncake master with this project's settings, as its own process.

    pdworker master --rpc-port P --admin-port A [--metadata-port M] [--host 127.0.0.1]

The process becomes `mooncake_master` (exec): the PID a launcher started is the master's, so
stopping it by PID stops the master, and nothing sits between them. Its three ports:
--rpc-port (workers' --master HOST:PORT), --metadata-port (their --metadata
http://HOST:PORT/metadata), --admin-port (/health, /metrics, /get_all_keys). Without
--metadata-port the master serves no metadata: Mooncake 0.3.13 binds its embedded metadata
server to 0.0.0.0 whatever --host says, so `pdrouter launch` runs `pdworker metadata` on the
host instead (pdrouter.launch.exposure lists what stays unauthenticated).
"""

from __future__ import annotations

import argparse
import os
import sys

from pdrouter.common.cli_args import ConfigError, add_flag
from workers.pool.master import MasterConfig, master_argv

_DEFAULTS = MasterConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default=_DEFAULTS.host, help="address every port binds")
    add_flag(parser, "--rpc-port", type=int, required=True, help="clients' master port")
    add_flag(parser, "--metadata-port", type=int, default=0,
             help="embedded HTTP metadata port (binds 0.0.0.0 whatever --host says); "
             "0: none, run `pdworker metadata`")  # fmt: skip
    add_flag(parser, "--admin-port", type=int, required=True,
             help="/health, /metrics, /get_all_keys")  # fmt: skip
    add_flag(parser, "--lease-ttl-ms", type=int, default=_DEFAULTS.lease_ttl_ms,
             help="how long a reader's lease keeps an object from eviction")  # fmt: skip
    add_flag(parser, "--client-ttl-s", type=int, default=_DEFAULTS.client_ttl_s,
             help="a silent client's memory is dropped after this long")  # fmt: skip
    add_flag(parser, "--put-discard-timeout-s", type=int,
             default=_DEFAULTS.put_discard_timeout_s,
             help="a crashed writer's keys may be written again after this long")  # fmt: skip
    add_flag(parser, "--put-release-timeout-s", type=int,
             default=_DEFAULTS.put_release_timeout_s,
             help="a crashed writer's space comes back after this long")  # fmt: skip
    add_flag(parser, "--log-level", type=int, default=_DEFAULTS.log_level,
             help="glog minloglevel: 0 info, 1 warning, 2 error")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    ports = (args.rpc_port, args.metadata_port, args.admin_port)
    given = [port for port in ports if port]
    if len(set(given)) != len(given) or min(args.rpc_port, args.admin_port) < 1:
        raise ConfigError(
            f"--rpc-port, --admin-port (and --metadata-port, if given) must be distinct ports: "
            f"{ports}"
        )
    config = MasterConfig(
        host=args.host,
        lease_ttl_ms=args.lease_ttl_ms,
        client_ttl_s=args.client_ttl_s,
        put_discard_timeout_s=args.put_discard_timeout_s,
        put_release_timeout_s=args.put_release_timeout_s,
        log_level=args.log_level,
    )
    try:
        argv = master_argv(config, *ports)
    except RuntimeError as exc:  # the binary is missing: say what to install
        print(f"pdworker master: {exc}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.flush()
    os.execv(argv[0], argv)
    return 1  # not reached: exec replaces this process
