"""Environment mirrors of CLI flags: <PREFIX><FLAG> is parsed exactly like the flag on the
command line (types, choices, required), for the subcommand that runs only."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pdrouter.common.cli_args import build_parser, env_name, parse_args
from tests.repo import REPO_ROOT


def _serve(parser: argparse.ArgumentParser) -> None:
    from pdrouter.common.cli_args import add_flag

    add_flag(parser, "--prefill", nargs="+", required=True, help="prefill URLs")
    add_flag(parser, "--verbose", action="store_true", help="talk more")
    add_flag(parser, "--policy", default="round_robin", choices=["round_robin", "least_loaded"])


def _launch(parser: argparse.ArgumentParser) -> None:
    from pdrouter.common.cli_args import add_flag

    add_flag(parser, "--prefill", type=int, default=1, help="number of prefill workers")
    add_flag(parser, "--port", type=int, default=8000, help="router port")


def _parse(argv: list[str], environ: dict[str, str], prefix: str = "PDROUTER_"):
    commands = {"serve": (_serve, "serve"), "launch": (_launch, "launch")}
    parser, subparsers = build_parser("t", "test", commands, prefix)
    return parse_args(parser, subparsers, argv, environ)


def test_env_name() -> None:
    assert env_name("--max-num-seqs") == "PDROUTER_MAX_NUM_SEQS"
    assert env_name("--max-num-seqs", "PDWORKER_") == "PDWORKER_MAX_NUM_SEQS"


def test_flags_without_env() -> None:
    args = _parse(["launch"], {})
    assert (args.prefill, args.port) == (1, 8000)
    with pytest.raises(SystemExit):
        _parse(["serve"], {})  # --prefill is required for serve


def test_env_values_parse_like_flags_and_the_command_line_wins() -> None:
    env = {"PDROUTER_PORT": "9001", "PDROUTER_VERBOSE": "yes",
           "PDROUTER_PREFILL": "http://a:1, http://b:2"}  # fmt: skip
    serve = _parse(["serve"], env)
    assert serve.prefill == ["http://a:1", "http://b:2"]
    assert serve.verbose is True
    assert _parse(["serve"], {**env, "PDROUTER_VERBOSE": "off"}).verbose is False
    launch = _parse(["launch", "--prefill", "3"], {**env, "PDROUTER_PREFILL": "7"})
    assert (launch.prefill, launch.port) == (3, 9001)


def test_one_variable_two_meanings() -> None:
    # PDROUTER_PREFILL holds URLs for serve; launch only fails if it would use that value.
    env = {"PDROUTER_PREFILL": "http://a:1"}
    assert _parse(["launch", "--prefill", "2"], env).prefill == 2
    with pytest.raises(SystemExit):
        _parse(["launch"], env)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "--prefill", "u", "--policy", "bogus"], {},
         "argument --policy: invalid choice: 'bogus'"),
        (["serve", "--prefill", "u"], {"PDROUTER_POLICY": "bogus"},
         "argument --policy: invalid choice: 'bogus'"),
        (["launch", "--port", "x"], {}, "argument --port: invalid int value: 'x'"),
        (["launch"], {"PDROUTER_PORT": "x"}, "argument --port: invalid int value: 'x'"),
        (["serve", "--prefill", "u"], {"PDROUTER_VERBOSE": "maybe"},
         "PDROUTER_VERBOSE='maybe': not a boolean"),
    ],
)  # fmt: skip
def test_a_bad_env_value_fails_exactly_like_the_same_flag(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(argv, env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if env:  # and it says where the value came from
        assert f"(flags from the environment: {', '.join(env)})" in err or message.startswith(
            "PDROUTER_VERBOSE"
        )


def test_each_command_reads_only_its_own_prefix() -> None:
    env = {"PDROUTER_PORT": "9001", "PDWORKER_PORT": "9002"}
    assert _parse(["launch"], env, "PDWORKER_").port == 9002
    assert _parse(["launch"], env, "PDROUTER_").port == 9001
    assert _parse(["launch"], {"PDROUTER_PORT": "9001"}, "PDWORKER_").port == 8000


def _run(module: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PDROUTER_", "PDWORKER_"))}
    full_env.update(env, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", module, *argv], env=full_env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("module", "argv", "env", "message"),
    [
        ("pdrouter.cli", ["serve", "--prefill", "http://127.0.0.1:1", "--decode",
                          "http://127.0.0.1:2"], {"PDROUTER_PREFILL_POLICY": "bogus"},
         "argument --prefill-policy: invalid choice: 'bogus'"),
        ("pdrouter.cli", ["launch"], {"PDROUTER_PREFILL": "two"},
         "argument --prefill: invalid int value: 'two'"),
        ("workers.cli", ["serve"], {"PDWORKER_ROLE": "bogus"},
         "argument --role: invalid choice: 'bogus'"),
        ("workers.cli", ["serve"], {"PDWORKER_MISSING_KV_POLICY": "maybe"},
         "argument --missing-kv-policy: invalid choice: 'maybe'"),
        ("workers.cli", ["serve", "--role", "prefill"], {},
         "pdworker serve --role prefill needs --master HOST:PORT and --metadata URL"),
        ("workers.cli", ["master"], {"PDWORKER_RPC_PORT": "1", "PDWORKER_METADATA_PORT": "1",
                                     "PDWORKER_ADMIN_PORT": "x"},
         "argument --admin-port: invalid int value: 'x'"),
    ],
)  # fmt: skip
def test_the_real_commands_refuse_bad_env_values_before_starting_anything(
    module: str, argv: list[str], env: dict[str, str], message: str
) -> None:
    """Values from the environment are checked like the flags they mirror: usage error,
    exit 2, argparse's message, nothing started."""
    result = _run(module, argv, env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_a_router_variable_does_not_reach_a_worker_command() -> None:
    # PDROUTER_ROLE means nothing to pdworker: the worker prefix is its own.
    result = _run("workers.cli", ["serve", "--help"], {"PDROUTER_ROLE": "bogus"})
    assert result.returncode == 0, result.stderr
    assert "[env PDWORKER_ROLE]" in " ".join(result.stdout.split())


def test_an_env_error_names_variables_never_their_values() -> None:
    """The message lists which flags came from the environment, not what they held: one of
    them may be a secret."""
    secret = "s3cr3t-value-never-printed"
    result = _run("workers.cli", ["serve"], {"PDWORKER_INTERNAL_SECRET": secret,
                                             "PDWORKER_BLOCK_SIZE": "bogus"})  # fmt: skip
    assert result.returncode == 2
    assert "argument --block-size: invalid int value: 'bogus'" in result.stderr
    assert "PDWORKER_INTERNAL_SECRET" in result.stderr and secret not in result.stderr


def test_a_flag_given_once_per_value_reads_a_list_from_its_variable() -> None:
    def serve(parser: argparse.ArgumentParser) -> None:
        from pdrouter.common.cli_args import add_flag

        add_flag(parser, "--router", action="append", default=None, help="router URL")

    parser, subparsers = build_parser("t", "test", {"serve": (serve, "serve")}, "PDWORKER_")
    env = {"PDWORKER_ROUTER": "http://a:1, http://b:2"}
    assert parse_args(parser, subparsers, ["serve"], env).router == ["http://a:1", "http://b:2"]
    given = ["serve", "--router", "http://c:3"]
    assert parse_args(parser, subparsers, given, env).router == ["http://c:3"]
    assert parse_args(parser, subparsers, ["serve"], {}).router is None
