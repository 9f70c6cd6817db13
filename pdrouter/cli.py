"""`pdrouter`: the router-side command line.

    pdrouter serve  --prefill URL [URL...] --decode URL [URL...] --port N
    pdrouter launch --prefill N --decode M [--mixed K] --model tiny|PATH --port 8000

Each subcommand's module owns its flags (add_arguments) and its entry (run). Nothing here
imports Paddle: `launch` starts workers as separate `pdworker` processes.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("pdrouter.serve", "route OpenAI requests through prefill and decode instances"),
    "launch": ("pdrouter.launcher", "start pool, workers and router on this host, supervised"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdrouter", description=__doc__.split("\n\n")[0])
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
