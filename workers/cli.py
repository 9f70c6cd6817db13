"""`pdworker`: the worker-side command line.

    pdworker serve --role mixed|prefill|decode --model tiny|demo|PATH --port N ...
    pdworker pool  --size 2GiB --master HOST:PORT --metadata URL [--port N]
    pdworker master --rpc-port P --admin-port A [--metadata-port M]
    pdworker metadata --host H --port M

Each subcommand's module owns its flags (add_arguments) and its entry (run); imports are lazy
so `pdworker pool` never loads Paddle.
"""

from __future__ import annotations

import sys

from pdrouter.common.cli_args import dispatch

SUBCOMMANDS = {
    "serve": ("workers.server.main", "serve a model (roles mixed, prefill, decode)"),
    "pool": ("workers.pool.owner", "own the Mooncake pool memory and serve /health"),
    "master": ("workers.pool.master_cmd", "run the Mooncake master with this project's settings"),
    "metadata": ("workers.pool.metadata_cmd", "serve Mooncake's transfer metadata on one address"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("pdworker", __doc__.split("\n\n")[0], SUBCOMMANDS, argv, "PDWORKER_")


if __name__ == "__main__":
    sys.exit(main())
