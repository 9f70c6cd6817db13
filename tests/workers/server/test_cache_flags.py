"""The prefix cache's worker flags reach PDSettings; bad values are a usage error."""

from __future__ import annotations

import argparse

import pytest

from pdrouter.common.cli_args import ConfigError
from workers.server.main import add_arguments, config_from_args

POOL = ["--role", "prefill", "--master", "127.0.0.1:1", "--metadata", "http://127.0.0.1:2/m"]


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args([*POOL, *flags]))


def test_defaults_are_the_settings_defaults() -> None:
    pd = _config().pd
    assert (pd.pool_prefix, pd.pool_prefix_min_tokens, pd.pool_load_timeout_s) == (True, 32, 2.0)
    assert (pd.writeback, pd.writeback_max_in_flight) == (True, 4)
    assert _config().engine.enable_prefix_cache


def test_flags_turn_each_part_off_or_set_it() -> None:
    cfg = _config("--no-prefix-cache", "--no-pool-prefix-cache", "--pool-prefix-min-tokens",
                  "64", "--pool-load-timeout-s", "0.5", "--no-decode-writeback",
                  "--writeback-max-in-flight", "2")  # fmt: skip
    pd = cfg.pd
    assert not cfg.engine.enable_prefix_cache
    assert (pd.pool_prefix, pd.pool_prefix_min_tokens, pd.pool_load_timeout_s) == (False, 64, 0.5)
    assert (pd.writeback, pd.writeback_max_in_flight) == (False, 2)


@pytest.mark.parametrize(
    "flags",
    [("--pool-load-timeout-s", "0"), ("--pool-prefix-min-tokens", "-1"),
     ("--writeback-max-in-flight", "0")],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_flag(flags: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match=flags[0]):
        _config(*flags)


def test_the_integrity_check_with_tensor_parallel_shards_is_refused_saying_why() -> None:
    assert _config("--pool-integrity", "on").pd.pool_integrity == "on"
    assert _config("--tensor-parallel-size", "2").engine.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"--pool-integrity on .* --tensor-parallel-size > 1"):
        _config("--pool-integrity", "on", "--tensor-parallel-size", "2")
