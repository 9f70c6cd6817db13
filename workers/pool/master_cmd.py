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

from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import add_flags, from_args
from workers.pool.master import MasterConfig, master_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdworker master`, one per flag()-marked field of MasterConfig."""
    add_flags(parser, MasterConfig)


def run(args: argparse.Namespace) -> int:
    config: MasterConfig = from_args(MasterConfig, args)
    ports = (config.rpc_port, config.metadata_port, config.admin_port)
    given = [port for port in ports if port]
    if len(set(given)) != len(given) or min(config.rpc_port, config.admin_port) < 1:
        raise ConfigError(
            f"--rpc-port, --admin-port (and --metadata-port, if given) must be distinct ports: "
            f"{ports}"
        )
    try:
        argv = master_argv(config, *ports)
    except RuntimeError as exc:  # the binary is missing: say what to install
        print(f"pdworker master: {exc}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.flush()
    os.execv(argv[0], argv)
    return 1  # not reached: exec replaces this process
