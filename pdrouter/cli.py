"""`pdrouter`: the router-side command line.

    pdrouter serve  --prefill URL [URL...] --decode URL [URL...] --port N
    pdrouter launch --prefill N --decode M [--mixed K] --model tiny|demo|PATH --port 8000

Each subcommand's module owns its flags (add_arguments) and its entry (run). Nothing here
imports Paddle: `launch` starts workers as separate `pdworker` processes.
"""

from __future__ import annotations

import sys

from pdrouter.common.cli_args import dispatch

SUBCOMMANDS = {
    "serve": (
        "pdrouter.router.serve",
        "route OpenAI requests through prefill and decode instances",
    ),
    "launch": (
        "pdrouter.launch.cli",
        "start pool, workers and router on this host, supervised",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("pdrouter", __doc__.split("\n\n")[0], SUBCOMMANDS, argv, "PDROUTER_")


if __name__ == "__main__":
    sys.exit(main())
