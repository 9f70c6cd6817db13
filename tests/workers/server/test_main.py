"""`pdworker serve`'s flags to WorkerConfig: several routers, the pool's advertised address."""

from __future__ import annotations

import pytest

from pdrouter.common.cli_args import build_parser, parse_args
from workers.server.config import RegistrationConfig, WorkerConfig
from workers.server.main import add_arguments, config_from_args

POOL = ["--master", "10.0.0.1:50051", "--metadata", "http://10.0.0.1:8080/metadata"]


def _config(argv: list[str], environ: dict[str, str] | None = None) -> WorkerConfig:
    commands = {"serve": (add_arguments, "serve")}
    parser, subparsers = build_parser("pdworker", "test", commands, "PDWORKER_")
    return config_from_args(parse_args(parser, subparsers, ["serve", *argv], environ or {}))


def test_each_router_gets_its_own_registration() -> None:
    cfg = _config(["--role", "decode", "--host", "10.0.0.3", "--port", "8100", *POOL,
                   "--router", "http://10.0.0.4:8000/", "--router", "http://10.0.0.4:8001",
                   "--router", "http://10.0.0.4:8000", "--admin-key", "k"])  # fmt: skip
    assert cfg.registration == (
        RegistrationConfig("http://10.0.0.4:8000", "http://10.0.0.3:8100", admin_key="k"),
        RegistrationConfig("http://10.0.0.4:8001", "http://10.0.0.3:8100", admin_key="k"),
    )


def test_routers_from_the_environment_and_none_for_mixed() -> None:
    env = {"PDWORKER_ROUTER": "http://r1:8000,http://r2:8000"}
    cfg = _config(["--role", "prefill", *POOL], env)
    assert [r.router_url for r in cfg.registration] == ["http://r1:8000", "http://r2:8000"]
    assert _config(["--role", "mixed"], env).registration == ()
    assert _config(["--role", "prefill", *POOL]).registration == ()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "127.0.0.1"), (["--pool-hostname", "10.0.0.2"], "10.0.0.2")],
)
def test_pool_hostname_reaches_the_pool_settings(argv: list[str], expected: str) -> None:
    cfg = _config(["--role", "prefill", *POOL, *argv])
    assert cfg.pd is not None and cfg.pd.local_hostname == expected


def test_a_worker_must_hold_at_least_one_request() -> None:
    from pdrouter.common.cli_args import ConfigError

    with pytest.raises(ConfigError, match=r"--max-pending-requests \(0\) must be >= 1"):
        _config(["--max-pending-requests", "0"])


def test_router_only_needs_the_internal_secret_and_takes_it_from_the_environment() -> None:
    from pdrouter.common.cli_args import ConfigError

    with pytest.raises(ConfigError, match=r"--router-only needs --internal-secret"):
        _config(["--router-only"])
    cfg = _config(["--router-only"], {"PDWORKER_INTERNAL_SECRET": "s3cret"})
    assert (cfg.router_only, cfg.internal_secret) == (True, "s3cret")
    assert _config([]).router_only is False
