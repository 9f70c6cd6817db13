"""Environment mirrors of CLI flags: PDROUTER_<FLAG> is a default, converted only where used."""

from __future__ import annotations

import argparse

import pytest

from pdrouter.common.cli_args import add_flag, env_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    add_flag(serve, "--prefill", nargs="+", required=True, help="prefill URLs")
    add_flag(serve, "--verbose", action="store_true", help="talk more")
    launch = sub.add_parser("launch")
    add_flag(launch, "--prefill", type=int, default=1, help="number of prefill workers")
    add_flag(launch, "--port", type=int, default=8000, help="router port")
    return parser


def test_env_name() -> None:
    assert env_name("--max-num-seqs") == "PDROUTER_MAX_NUM_SEQS"


def test_flags_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDROUTER_PREFILL", raising=False)
    monkeypatch.delenv("PDROUTER_PORT", raising=False)
    args = _parser().parse_args(["launch"])
    assert (args.prefill, args.port) == (1, 8000)
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve"])  # --prefill is required for serve


def test_env_values_are_typed_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDROUTER_PORT", "9001")
    monkeypatch.setenv("PDROUTER_VERBOSE", "yes")
    monkeypatch.setenv("PDROUTER_PREFILL", "http://a:1, http://b:2")
    serve = _parser().parse_args(["serve"])
    assert serve.prefill == ["http://a:1", "http://b:2"]
    assert serve.verbose is True
    # The command line still wins over the environment.
    launch = _parser().parse_args(["launch", "--prefill", "3"])
    assert (launch.prefill, launch.port) == (3, 9001)


def test_one_variable_two_meanings(monkeypatch: pytest.MonkeyPatch) -> None:
    # PDROUTER_PREFILL holds URLs for serve; launch only fails if it would use that value.
    monkeypatch.setenv("PDROUTER_PREFILL", "http://a:1")
    assert _parser().parse_args(["launch", "--prefill", "2"]).prefill == 2
    with pytest.raises(SystemExit):
        _parser().parse_args(["launch"])
