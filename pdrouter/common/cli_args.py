"""argparse flags with environment mirrors: --foo-bar reads PDROUTER_FOO_BAR when not given.

The only place (with the two CLI modules) that reads the environment for settings.

A scalar flag's env value is handed to argparse as a *string* default, which argparse converts
with the flag's `type` only when that default is used. So one variable may mean different things
to different subcommands (PDROUTER_PREFILL holds URLs for `serve`, a count for `launch`) and only
the subcommand that runs interprets it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "PDROUTER_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _env_list(env: str, raw: str, conv: Any) -> list[Any]:
    try:
        return [conv(v) for v in raw.replace(",", " ").split()]
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{env}={raw!r}: {exc}") from None


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """parser.add_argument(flag, ...) whose default comes from PDROUTER_<FLAG> when set.

    List flags (nargs) read the variable as whitespace- or comma-separated values; booleans
    (store_true) accept 1/true/yes/on.
    """
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kwargs.get("nargs") in ("+", "*"):
            kwargs["default"] = _env_list(env, raw, kwargs.get("type", str))
            kwargs["required"] = False
        else:
            kwargs["default"] = raw  # converted by argparse only if this default is used
            kwargs["required"] = False
    help_text = kwargs.get("help", "")
    default = kwargs.get("default")
    shown = f" (default: {default})" if default not in (None, [], False) else ""
    kwargs["help"] = f"{help_text}{shown} [env {env}]"
    parser.add_argument(flag, **kwargs)


def dispatch(
    prog: str, description: str, subcommands: dict[str, tuple[str, str]], argv: list[str] | None
) -> int:
    """Parse argv for prog and run the chosen subcommand.

    subcommands maps name -> (module, help); each module exposes add_arguments(parser) and
    run(args) -> int. Modules are imported here, not at the CLI's import, so a subcommand that
    needs no Paddle never loads it.
    """
    import importlib

    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in subcommands.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)
