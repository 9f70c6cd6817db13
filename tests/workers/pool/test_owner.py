"""`pdworker pool`: health, metrics, clean SIGTERM, and the memory dies with the owner."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.wait import wait_until
from tests.workers.pool.fixtures import capacity_bytes, start_pool
from workers.pool.connect import parse_host_port, probe_tcp
from workers.pool.local_pool import LocalPool

MiB = 1 << 20


def _wait_closed(addr: str, timeout_s: float = 10.0) -> None:
    """Until nothing listens at addr any more (the probe reports an error)."""
    wait_until(lambda: probe_tcp(*parse_host_port(addr, "owner")), timeout_s, f"{addr} closed")


@pytest.fixture
def pool(tmp_path):
    pool = start_pool(tmp_path / "pool", size_bytes=64 * MiB)
    try:
        yield pool
    finally:
        pool.stop()


def test_health_metrics_and_mounted_capacity(pool):
    addr = pool.addresses
    health = httpx.get(addr.owner_url + "/health", timeout=5)
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "owner_addr": addr.owner_addr,
        "size_bytes": 64 * MiB,
        "master": addr.master_addr,
        "metadata": addr.metadata_url,
    }
    metrics = httpx.get(addr.owner_url + "/metrics", timeout=5).text
    assert "pdpool_owner_size_bytes 6.7108864e+07" in metrics
    assert "pdpool_owner_up 1.0" in metrics
    assert "mooncake_client_rpc_count" in metrics  # the child's own counters follow ours
    assert httpx.get(addr.owner_url + "/nope", timeout=5).status_code == 404
    assert capacity_bytes(addr.admin_url) == 64 * MiB


def test_sigterm_stops_cleanly_and_unmounts(pool):
    addr = pool.addresses
    assert pool.owner.stop() == 0
    _wait_closed(addr.owner_addr)
    # The master forgets the segment within its client_ttl (2 s).
    wait_until(
        lambda: capacity_bytes(addr.admin_url), 10, "the master to forget the segment",
        done=lambda n: n == 0,
    )  # fmt: skip


def test_memory_dies_with_the_owner_even_when_killed_by_pid_alone(pool):
    addr = pool.addresses
    os.kill(pool.owner.pid, signal.SIGKILL)  # not the group: only PR_SET_PDEATHSIG helps
    _wait_closed(addr.owner_addr)
    pool.owner.popen.wait(timeout=10)
    assert pool.owner.returncode == -signal.SIGKILL


class FlakyStartPool(LocalPool):
    """A pool whose first owner start dies before it is ready (as one whose port another
    process took first), then starts for real."""

    def __init__(self, *args, failures: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures, self.tries = failures, 0

    def _start_owner_once(self, timeout_s: float, keep_ports: bool = False) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise RuntimeError("pdworker pool exited with code 1 before it was ready")
        super()._start_owner_once(timeout_s, keep_ports)


def test_an_owner_that_dies_before_ready_is_started_again(tmp_path) -> None:
    pool = FlakyStartPool(64 * 1024 * 1024, log_dir=tmp_path, failures=2)
    try:
        pool.start()
        assert pool.tries == 3
        assert httpx.get(pool.addresses.owner_url + "/health", timeout=5).status_code == 200
    finally:
        pool.stop()
    always = FlakyStartPool(64 * 1024 * 1024, log_dir=tmp_path / "always", failures=3)
    try:
        with pytest.raises(RuntimeError, match="exited with code 1"):
            always.start()
        assert always.tries == 3
    finally:
        always.stop()


def _child_env_and_argv(owner_pid: int) -> tuple[dict[str, str], list[str]]:
    """Environment and argv of the owner's mooncake_client child (read from /proc)."""
    children = Path(f"/proc/{owner_pid}/task/{owner_pid}/children").read_text().split()
    for child in children:
        if Path(f"/proc/{child}/comm").read_text().startswith("mooncake_client"):
            items = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            env = dict(i.decode().split("=", 1) for i in items if b"=" in i)
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            return env, argv
    raise AssertionError(f"no mooncake_client among the children {children} of {owner_pid}")


def test_the_child_is_started_as_the_device_pointer_path_needs(pool):
    """Same-host copies by memcpy (over CUDA IPC for a device pointer) into a segment pinned
    whole, and 8 service threads for concurrent calls; harmless with the CPU wheel."""
    env, argv = _child_env_and_argv(pool.owner.pid)
    assert env["MC_STORE_MEMCPY"] == "1"
    assert env["MC_STORE_PIN_MEMORY_MAX_BYTES"] == str(2 * 64 * MiB)
    assert "--threads=8" in argv
