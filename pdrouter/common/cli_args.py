"""argparse flags with environment mirrors, checked exactly like the command line.

The flags themselves are generated from the config dataclasses (pdrouter.common.flags, which
calls add_flag here for each); this module gives each one its variable and runs the commands.

Each command has its own prefix, so that a variable meant for one never steers the other:
`pdrouter ...` reads PDROUTER_<FLAG>, `pdworker ...` reads PDWORKER_<FLAG> (the launcher starts
both kinds on one host). The only place (with the CLI modules) that reads settings from the
environment.

A variable is read only for the subcommand that runs, and it is not a default: its value is
parsed as if it had been given on the command line, before the real arguments (which win), so
argparse checks types, choices and required flags the same way and fails with the same
message and exit code 2:

    PDROUTER_PREFILL_POLICY=bogus pdrouter serve ...
    pdrouter serve: error: argument --prefill-policy: invalid choice: 'bogus' (choose from ...)
                    (flags from the environment: PDROUTER_PREFILL_POLICY)

One variable may mean different things to different subcommands (PDROUTER_PREFILL holds URLs
for `serve`, a count for `launch`): only the subcommand that runs interprets it. List flags
(nargs) and flags given once per value (action="append") read whitespace- or comma-separated
values; booleans (store_true) 1/true/yes/on or
0/false/no/off.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class _Mirror:
    flag: str
    env: str
    kind: str  # "bool" | "list" | "append" | "value"


class ConfigError(ValueError):
    """Settings that cannot work together; the CLI prints it as a usage error (exit 2)."""


class MirroredParser(argparse.ArgumentParser):
    """An ArgumentParser whose add_flag()-made flags mirror env_prefix variables."""

    def __init__(self, *args: Any, env_prefix: str = "PDROUTER_", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.mirrors: list[_Mirror] = []
        self._env_names: list[str] = []  # the variables the environment contributed

    def env_tokens(self, argv: list[str], environ: dict[str, str]) -> list[str]:
        """The command-line tokens the environment stands for, for flags argv lacks."""
        given = {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}
        tokens: list[str] = []
        for m in self.mirrors:
            raw = environ.get(m.env)
            if raw is None or m.flag in given:
                continue
            self._env_names.append(m.env)
            if m.kind == "bool":
                value = raw.strip().lower()
                if value not in _TRUE | _FALSE:
                    self.error(f"{m.env}={raw!r}: not a boolean (1/true/yes/on, 0/false/no/off)")
                if value in _TRUE:
                    tokens.append(m.flag)
            elif m.kind == "list":
                tokens += [m.flag, *raw.replace(",", " ").split()]
            elif m.kind == "append":  # a flag given once per value
                tokens += [f"{m.flag}={value}" for value in raw.replace(",", " ").split()]
            else:
                tokens.append(f"{m.flag}={raw}")
        return tokens

    def error(self, message: str) -> NoReturn:
        if self._env_names:  # names only: a value may be a secret
            message += f" (flags from the environment: {', '.join(self._env_names)})"
        super().error(message)


def env_name(flag: str, prefix: str = "PDROUTER_") -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    group: Any = None,
    aliases: tuple[str, ...] = (),
    **kwargs: Any,
) -> None:
    """parser.add_argument(flag, ...) (in group, an argument group of parser, when given),
    mirrored by <prefix><FLAG> when parser is a MirroredParser (the prefix is its env_prefix).
    The flags of the commands come from their config dataclasses (pdrouter.common.flags)."""
    prefix = getattr(parser, "env_prefix", "PDROUTER_")
    env = env_name(flag, prefix)
    if kwargs.get("action") == "store_true":
        kind = "bool"
    elif kwargs.get("nargs") in ("+", "*"):
        kind = "list"
    elif kwargs.get("action") == "append":
        kind = "append"
    else:
        kind = "value"
    help_text = kwargs.get("help", "")
    default = kwargs.get("default")
    hidden = default is None or default is False or default in ([], (), "")
    shown = "" if hidden else f" (default: {default})"
    kwargs["help"] = f"{help_text}{shown} [env {env}]"
    (group or parser).add_argument(flag, *aliases, **kwargs)
    if isinstance(parser, MirroredParser):
        parser.mirrors.append(_Mirror(flag, env, kind))


def build_parser(
    prog: str,
    description: str,
    commands: dict[str, tuple[Callable[[argparse.ArgumentParser], None], str]],
    env_prefix: str,
) -> tuple[argparse.ArgumentParser, dict[str, MirroredParser]]:
    """The top parser with one MirroredParser per subcommand (name -> (add_arguments, help))."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=MirroredParser)
    subparsers: dict[str, MirroredParser] = {}
    for name, (add_arguments, help_text) in commands.items():
        sub_parser = sub.add_parser(
            name, help=help_text, description=help_text, env_prefix=env_prefix
        )
        add_arguments(sub_parser)
        subparsers[name] = sub_parser
    return parser, subparsers


def parse_args(
    parser: argparse.ArgumentParser,
    subparsers: dict[str, MirroredParser],
    argv: list[str],
    environ: dict[str, str],
) -> argparse.Namespace:
    """argv parsed with the chosen subcommand's environment mirrors put in front of its own
    arguments (which therefore win)."""
    command = next((tok for tok in argv if tok in subparsers), None)
    if command is not None:
        at = argv.index(command)
        extra = subparsers[command].env_tokens(argv[at + 1 :], environ)
        argv = argv[: at + 1] + extra + argv[at + 1 :]
    return parser.parse_args(argv)


def dispatch(
    prog: str,
    description: str,
    subcommands: dict[str, tuple[str, str]],
    argv: list[str] | None,
    env_prefix: str,
) -> int:
    """Parse argv (and the env_prefix mirrors of the chosen subcommand) and run it.

    subcommands maps name -> (module, help); each module exposes add_arguments(parser) and
    run(args) -> int. Modules are imported here, not at the CLI's import, so a subcommand that
    needs no Paddle never loads it. A ConfigError from run() is a usage error (exit 2).
    """
    modules = {name: importlib.import_module(mod) for name, (mod, _) in subcommands.items()}
    commands = {
        name: (modules[name].add_arguments, help_text)
        for name, (_, help_text) in subcommands.items()
    }
    parser, subparsers = build_parser(prog, description, commands, env_prefix)
    args = parse_args(
        parser, subparsers, list(sys.argv[1:] if argv is None else argv), dict(os.environ)
    )
    try:
        return int(modules[args.command].run(args) or 0)
    except ConfigError as exc:
        subparsers[args.command].error(str(exc))
