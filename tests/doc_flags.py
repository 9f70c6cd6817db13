"""The command-line flags that exist, for the prose check of the flags the docs name
(tests/test_prose_refs.py).

A flag exists when it is one of:
- a flag of a `pdrouter` or `pdworker` subcommand, read from the parser that subcommand
  builds (pdrouter.cli.SUBCOMMANDS, workers.cli.SUBCOMMANDS: each module's add_arguments, as
  tests/pdrouter/common/test_flags.py builds them);
- a flag some other command of the repository adds (a benchmark, the TP peer, a test
  tool): an `add_argument("--name", ...)` call in a .py file of the repository, read
  from its source, since those parsers are built inside their main();
- a flag of an outside tool the docs tell how to run, in EXTERNAL_FLAGS with the tool and
  the reason it is named.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from functools import cache

from pdrouter.common.cli_args import build_parser
from tests.repo import REPO_ROOT

# Flags of tools outside this repository that the docs name: (tool, why the docs name it,
# its flags they use).
EXTERNAL_TOOLS: tuple[tuple[str, str, str], ...] = (
    (
        "mooncake_master",
        "the master's flags the project sets or works around",
        "--client_ttl --http_metadata_server_host",
    ),
    (
        "mooncake_client",
        "how the owner's child reads its metadata server (gflags)",
        "--metadata_server --tryfromenv",
    ),
    ("pytest", "the test commands (pytest-xdist's mode)", "--dist"),
    ("pip", "install steps", "--no-deps --no-index --target"),
    ("prometheus", "the dashboard example's scrape config", "--config.file"),
    ("lm_eval", "lm-eval run against the router", "--model_args"),
    ("compute-sanitizer", "the kernel's memory check", "--tool"),
    (
        "sglang-router",
        "the gateway the router benchmark compares against",
        "--pd-disaggregation --policy",
    ),
    (
        "aiperf",
        "the serving benchmark's load generator, its command line as run",
        "--endpoint-type --streaming --request-count --warmup-request-count "
        "--prompt-input-tokens-mean --prompt-input-tokens-stddev --prompt-output-tokens-mean "
        "--prompt-output-tokens-stddev --extra-inputs --random-seed --output-artifact-dir "
        "--no-server-metrics --no-gpu-telemetry --request-timeout-seconds --ui-type",
    ),
    (
        "tyro",
        "how it names a nested flag by path: why it was not taken",
        "--orchestrator.timeouts.connect-s",
    ),
)
EXTERNAL_FLAGS = frozenset(flag for _, _, flags in EXTERNAL_TOOLS for flag in flags.split())

# A flag in prose: two dashes, a letter, then letters, digits, _ . - (ending in neither . nor -).
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w.-]*[\w]|--[A-Za-z])(?![\w-])")


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


@cache
def command_flags() -> frozenset[str]:
    """Every flag of every pdrouter and pdworker subcommand, from their parsers."""
    import pdrouter.cli
    import workers.cli

    flags: set[str] = set()
    for prog, commands, prefix in (
        ("pdrouter", pdrouter.cli.SUBCOMMANDS, "PDROUTER_"),
        ("pdworker", workers.cli.SUBCOMMANDS, "PDWORKER_"),
    ):
        for name, (module, help_text) in commands.items():
            add_arguments = importlib.import_module(module).add_arguments
            _, subparsers = build_parser(prog, "docs", {name: (add_arguments, help_text)}, prefix)
            flags |= _parser_flags(subparsers[name])
    return frozenset(flags)


def _added_flags(source: str) -> set[str]:
    """The "--name" arguments of every add_argument call in source."""
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    flags.add(arg.value)
    return flags


@cache
def script_flags(files: tuple[str, ...]) -> frozenset[str]:
    """The flags the other parsers among files add (benchmarks, tools, the TP peer)."""
    flags: set[str] = set()
    for name in files:
        if name.endswith(".py") and "add_argument" in (text := (REPO_ROOT / name).read_text()):
            flags |= _added_flags(text)
    return frozenset(flags)


def check_flag(flag: str, files: tuple[str, ...]) -> str | None:
    """None when flag exists (argparse's --help too) for the repository of files, else why not."""
    if flag == "--help" or flag in EXTERNAL_FLAGS or flag in command_flags():
        return None
    if flag in script_flags(files):
        return None
    return "no command of the repo, nor a tool the docs run, has this flag"
