"""`pdworker`: the worker-side command line.

    pdworker serve --role mixed|prefill|decode --model tiny|PATH --port N ...
    pdworker pool  --size 2GiB --master HOST:PORT --metadata URL [--port N]

Each subcommand's module owns its flags (add_arguments) and its entry (run); imports are lazy
so `pdworker pool` never loads Paddle.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("workers.server.main", "serve a model (roles mixed, prefill, decode)"),
    "pool": ("workers.pool.owner", "own the Mooncake pool memory and serve /health"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdworker", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
