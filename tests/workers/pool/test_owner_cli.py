"""`pdworker pool` argument handling and failure messages (no pool needed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdrouter.common.proc import find_free_port
from tests.repo import REPO_ROOT
from workers.pool.owner_process import owner_env, parse_size_bytes


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("512mb", 512 << 20),
        ("1.5G", 3 << 29),
        ("64KiB", 64 << 10),
        ("1048576", 1 << 20),
        (" 3 TiB ", 3 << 40),
    ],
)
def test_parse_size(text, num_bytes):
    assert parse_size_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1GiB", "2 GiB extra"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size_bytes(text)


def _pool_cli(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "pool", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO_ROOT),
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


def test_unreachable_master_fails_fast_naming_the_flag():
    port = find_free_port()
    code, err, elapsed_s = _pool_cli(
        "--size=64MiB", f"--master=127.0.0.1:{port}", "--metadata=http://127.0.0.1:1/metadata"
    )
    assert code == 1
    assert f"cannot reach the Mooncake master at 127.0.0.1:{port}" in err
    assert "--master / PDWORKER_MASTER" in err
    assert elapsed_s < 10


def test_bad_size_is_a_usage_error():
    code, err, _ = _pool_cli("--size=lots", "--master=127.0.0.1:1", "--metadata=http://x:1/m")
    assert code == 2
    assert "--size: not a size: 'lots'" in err


def test_owner_env_keeps_the_rest_and_pins_at_least_twice_the_segment() -> None:
    assert owner_env(1 << 30, {"PATH": "/bin"}) == {
        "PATH": "/bin",
        "MC_STORE_MEMCPY": "1",
        "MC_STORE_PIN_MEMORY_MAX_BYTES": str(2 << 30),
    }
    larger = owner_env(1 << 30, {"MC_STORE_PIN_MEMORY_MAX_BYTES": str(8 << 30)})
    assert larger["MC_STORE_PIN_MEMORY_MAX_BYTES"] == str(8 << 30)
