"""Flags generated from the config dataclasses (pdrouter.common.flags): the same flag names
and environment names as the hand-written tables had, each default taken from its field, the
dataclass built back exactly, and the shapes a field's annotation gives."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import Literal

import pytest

from pdrouter.common.cli_args import build_parser, parse_args
from pdrouter.common.flags import add_flags, flag, from_args
from pdrouter.launch.spec import ClusterSpec
from pdrouter.router.config import RouterConfig
from pdrouter.router.orchestrator.config import HopTimeouts, OrchestratorConfig
from workers.engine.engine_config import EngineConfig
from workers.pool.master import MasterConfig
from workers.server.config import AppConfig, WorkerConfig

# The flags of every command as the hand-written tables defined them: docs/deploy.md,
# examples/*.sh and pdrouter/launch/cluster.py use these names (and their env mirrors).
FLAGS = {
    ("pdrouter", "launch", "pdrouter.launch.cli"): "--admin-key --api-key --api-keys-file "
    "--cpu-affinity --decode "
    "--decode-tp --device --engine-backend --internal-secret --log-dir --max-restarts --mixed "
    "--mixed-tp --model "
    "--pool-size --pool-tcp --port --prefill --prefill-tp --router-args "
    "--tensor-parallel-size --worker-args",
    ("pdrouter", "serve", "pdrouter.router.serve"): "--abandon-after-s --admin-key --api-key "
    "--api-keys-file --api-keys-reload-s "
    "--batches-in-flight-per-instance --body-timeout-s --breaker-cooldown-s --breaker-failures "
    "--breaker-half-open-calls --breaker-trial-wait-s --busy-health-timeout-s "
    "--cache-events-interval-s --cache-load-weight "
    "--connect-timeout-s --decode --decode-policy --decode-timeout-s --head-timeout-s "
    "--health-interval-s --healthy-after --heartbeat-ttl-s --host --internal-secret "
    "--local-prefill-below-tokens --log-level --max-body-bytes --max-bytes-per-token "
    "--max-decode-attempts "
    "--max-header-bytes --max-headers --max-in-flight --max-in-flight-per-instance "
    "--max-prefill-attempts --max-queue-wait-s --max-queued-requests --max-request-tokens "
    "--missing-kv-policy --no-early-decode --otlp-endpoint --port --prefill "
    "--prefill-policy --prefill-timeout-s --share-cache-across-keys --startup-wait-s "
    "--timeline-capacity --unhealthy-after --upstream-client --urgent-priority --urgent-reserve",
    ("pdworker", "master", "workers.pool.master_cmd"): "--admin-port --client-ttl-s --host "
    "--lease-ttl-ms --log-level --metadata-port --put-discard-timeout-s "
    "--put-release-timeout-s --rpc-port",
    ("pdworker", "metadata", "workers.pool.metadata_cmd"): "--host --port",
    ("pdworker", "pool", "workers.pool.owner"): "--admin-key --host --master --metadata "
    "--no-prefault --owner-port --port --size --threads",
    ("pdworker", "serve", "workers.server.main"): "--admin-key --advertise-url --api-key "
    "--block-size --body-timeout-s --cuda-graphs --decode-attention --device --dtype "
    "--engine-backend --grammar-compile-timeout-s --grammar-max-schema-bytes --handoff-path "
    "--head-timeout-s --heartbeat-interval-s "
    "--host "
    "--internal-secret --log-level --master --max-body-bytes --max-header-bytes --max-headers "
    "--max-model-len --max-num-batched-tokens --max-num-seqs --max-pending-requests --metadata "
    "--missing-kv-policy --model --model-cache-dir --no-decode-writeback --no-pool-prefix-cache "
    "--no-prefix-cache --no-write-while-computing --num-kv-blocks --otlp-endpoint "
    "--pool-hostname --pool-integrity "
    "--pool-load-timeout-s --pool-owner --pool-prefix-min-tokens --pool-wait-s --port "
    "--prefetch-max-fraction --prefetch-poll-s --prefetch-ttl-s --role "
    "--router --router-only --seed --served-model-name --staging-slots --swap-space "
    "--tensor-parallel-size "
    "--transfer-batch-blocks "
    "--write-policy --write-through-threshold --writeback-max-in-flight",
}


def _parsers(prog: str, command: str, module: str):
    commands = {command: (importlib.import_module(module).add_arguments, command)}
    prefix = "PDROUTER_" if prog == "pdrouter" else "PDWORKER_"
    return build_parser(prog, "test", commands, prefix)


def _parsed(prog: str, command: str, module: str, argv: list[str], env: dict[str, str]):
    parser, subparsers = _parsers(prog, command, module)
    return parse_args(parser, subparsers, [command, *argv], env), subparsers[command]


@pytest.mark.parametrize(("key", "names"), FLAGS.items(), ids=[" ".join(k[:2]) for k in FLAGS])
def test_every_command_keeps_its_flag_and_env_names(key: tuple[str, str, str], names: str) -> None:
    prog, command, module = key
    sub = _parsers(prog, command, module)[1][command]
    flags = {a.option_strings[0] for a in sub._actions if a.option_strings[0] != "-h"}
    assert sorted(flags) == names.split()
    prefix = "PDROUTER_" if prog == "pdrouter" else "PDWORKER_"
    expected = {prefix + name[2:].replace("-", "_").upper() for name in names.split()}
    assert {m.env for m in sub.mirrors} == expected


def test_no_flags_give_the_dataclass_defaults() -> None:
    args, _ = _parsed("pdrouter", "serve", "pdrouter.router.serve", [], {})
    assert from_args(RouterConfig, args) == RouterConfig()
    from workers.server.main import config_from_args

    args, _ = _parsed("pdworker", "serve", "workers.server.main", [], {})
    assert config_from_args(args) == WorkerConfig(
        role="mixed", app=AppConfig("mixed", ("tiny",)), engine=EngineConfig()
    )
    args, _ = _parsed("pdrouter", "launch", "pdrouter.launch.cli", [], {})
    assert from_args(ClusterSpec, args) == ClusterSpec(router_port=8000)  # its one CLI default
    args, _ = _parsed("pdworker", "master", "workers.pool.master_cmd",
                      ["--rpc-port", "1", "--admin-port", "2"], {})  # fmt: skip
    assert from_args(MasterConfig, args) == MasterConfig(rpc_port=1, admin_port=2)


def test_nested_flags_env_and_command_line_reach_the_nested_field() -> None:
    env = {"PDROUTER_CONNECT_TIMEOUT_S": "0.5", "PDROUTER_MAX_PREFILL_ATTEMPTS": "7"}
    argv = ["--max-prefill-attempts", "2", "--decode-timeout-s", "9"]
    args, _ = _parsed("pdrouter", "serve", "pdrouter.router.serve", argv, env)
    cfg = from_args(RouterConfig, args)
    assert cfg.orchestrator == OrchestratorConfig(
        timeouts=HopTimeouts(connect_s=0.5, decode_event_s=9.0), max_prefill_attempts=2
    )


def test_a_bad_nested_env_value_exits_2_naming_the_variable_not_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"PDROUTER_CONNECT_TIMEOUT_S": "sekrit-token", "PDROUTER_API_KEY": "key-value"}
    with pytest.raises(SystemExit) as info:
        _parsed("pdrouter", "serve", "pdrouter.router.serve", [], env)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "argument --connect-timeout-s: invalid float value" in err
    assert "PDROUTER_CONNECT_TIMEOUT_S" in err
    assert "key-value" not in err


@dataclass(frozen=True)
class _Inner:
    """What the inner group holds."""

    mode: Literal["a", "b"] = field(default="a", metadata=flag("--mode", "a mode"))


@dataclass(frozen=True)
class _Outer:
    names: tuple[str, ...] = field(default=("x",), metadata=flag("--name", "names", nargs="+"))
    fast: bool = field(default=True, metadata=flag("--no-fast", "slow down", negate=True))
    size: int = field(default=2048, metadata=flag("--size", "a size", parse=lambda t: int(t) * 2))
    limit: int | None = field(default=None, metadata=flag("--limit", "a limit"))
    unflagged: float = 0.5
    inner: _Inner = field(default_factory=_Inner)


def _outer(argv: list[str]) -> _Outer:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Outer)
    return from_args(_Outer, parser.parse_args(argv), unflagged=0.25)


def test_the_annotation_gives_the_flag_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert _outer([]) == _Outer(unflagged=0.25)
    got = _outer(["--name", "p", "q", "--no-fast", "--size", "3", "--limit", "4", "--mode", "b"])
    assert got == _Outer(("p", "q"), False, 6, 4, 0.25, _Inner("b"))
    with pytest.raises(SystemExit):
        _outer(["--mode", "c"])
    assert "argument --mode: invalid choice: 'c' (choose from 'a', 'b')" in capsys.readouterr().err


def test_help_groups_nested_dataclasses_and_shows_defaults() -> None:
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, _Outer)
    text = parser.format_help()
    assert "inner:\n  What the inner group holds.\n" in text
    assert "--size SIZE" in text or "--size N" in text
    assert "a size (default: 2048)" in " ".join(text.split())
