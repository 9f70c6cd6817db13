"""An attacker's audit of a launched cluster: every open door fails this test.

`pdrouter launch --prefill 1 --decode 1` with an API key (given in the environment, as a
deployer should), and PDROUTER_HOST / PDWORKER_HOST set to 0.0.0.0 in the launcher's own
environment (they once moved every child onto every interface while the launcher printed
127.0.0.1). Then, for every process the launcher started (the whole process tree):

- every listening socket is bound to 127.0.0.1, or is one of the Mooncake sockets listed in
  pdrouter.launch.exposure, exactly (a new one fails until it is listed and documented; with
  --pool-tcp too, on a cluster of its own);
- no command line holds a secret; the admin key file is 0600; the launcher prints its path.

What every route of every server answers to each key, under each configuration (none,
--api-key, a keys file, both), is tests/e2e/security/test_doors_matrix.py.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.exposure import EXPOSURES, POOL_TCP_EXPOSURES
from pdrouter.launch.secrets import ADMIN_KEY_FILE
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.security.listeners import Listener, listeners, process_tree
from tests.pdrouter.launch.launch_cli import start_launch
from tests.wait import wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-audit-" + "7" * 24
HOST = "127.0.0.1"
# What each of our processes is, from its command line; Mooncake's by their binary's name.
ROLES = (
    ("pdrouter.cli launch", "launcher"),
    ("pdrouter.cli serve", "router"),
    ("workers.cli serve", "worker"),
    ("workers.cli pool", "pool owner"),
    ("workers.cli metadata", "pdworker metadata"),
    ("mooncake_master", "mooncake_master"),
    ("mooncake_client", "mooncake_client"),
)
MOONCAKE = {e.process for e in EXPOSURES}


@dataclass
class Launched:
    proc: ManagedProcess
    port: int
    log_dir: Path

    @property
    def admin_key(self) -> str:
        return (self.log_dir / ADMIN_KEY_FILE).read_text().strip()

    def tree(self) -> list[int]:
        return process_tree(self.proc.pid)


def _role(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    raise AssertionError(f"pid {pid} is no process the launcher should start: {cmdline!r}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Launched]:
    tmp = tmp_path_factory.mktemp("audit")
    port = find_free_port()
    proc = start_launch(port, tmp, tiny_cache_dir, env={"PDROUTER_API_KEY": API_KEY,
                        "PDROUTER_HOST": "0.0.0.0", "PDWORKER_HOST": "0.0.0.0"})  # fmt: skip
    try:

        def ready() -> bool:
            assert proc.alive(), f"launcher exited {proc.returncode}:\n{proc.log_tail()}"
            return f"router ready: http://{HOST}:{port}/v1" in proc.log_tail(100_000)

        wait_until(ready, 240, "the launched cluster", interval_s=0.2)
        yield Launched(proc, port, tmp / "logs")
    finally:
        proc.stop()


def _by_role(launched: Launched) -> dict[str, list[Listener]]:
    found: dict[str, list[Listener]] = {}
    for listener in listeners(launched.tree()):
        found.setdefault(_role(listener.pid), []).append(listener)
    return found


def _census(found: dict[str, list[Listener]]) -> tuple[dict[str, list[str]], Counter]:
    """(our HTTP listeners' hosts by role, Counter of every other socket as (process, bind))."""
    ours: dict[str, list[str]] = {}
    others: Counter = Counter()
    for role, lsns in found.items():
        for lsn in lsns:
            if role in MOONCAKE or lsn.host != HOST:
                others[(role, "host" if lsn.host == HOST else lsn.host)] += 1
            else:
                ours.setdefault(role, []).append(lsn.host)
    return ours, others


def test_every_socket_is_bound_to_the_host_or_a_listed_mooncake_exception(
    launched: Launched,
) -> None:
    ours, others = _census(_by_role(launched))
    # One HTTP port each, on the host the launcher printed, none on 0.0.0.0.
    assert ours == {"router": [HOST], "worker": [HOST, HOST], "pool owner": [HOST]}
    assert others == Counter((e.process, e.bind) for e in EXPOSURES)


def test_pool_tcp_adds_only_the_listed_worker_sockets(tiny_cache_dir: Path, tmp_path: Path) -> None:
    """Workers that reach the pool over TCP run transfer engines of their own."""
    spec = ClusterSpec(
        num_prefill=1, num_decode=1, pool_size="128MiB", api_key=API_KEY, shared_memory=False,
        worker_args=("--num-kv-blocks", "32", "--model-cache-dir", str(tiny_cache_dir)),
        log_dir=str(tmp_path), startup_timeout_s=240.0,
    )  # fmt: skip
    with Cluster(spec) as cluster:
        pids = [pid for c in cluster.children if c.proc for pid in process_tree(c.proc.pid)]
        found: dict[str, list[Listener]] = {}
        for listener in listeners(pids):
            found.setdefault(_role(listener.pid), []).append(listener)
    ours, others = _census(found)
    assert ours == {"router": [HOST], "worker": [HOST, HOST], "pool owner": [HOST]}
    per_worker = [(e.process, e.bind) for e in POOL_TCP_EXPOSURES]
    assert others == Counter((e.process, e.bind) for e in EXPOSURES) + Counter(per_worker * 2)


def _secrets(launched: Launched) -> dict[str, str]:
    router_pid = next(pid for pid in launched.tree() if _role(pid) == "router")
    raw = Path(f"/proc/{router_pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    return {
        "api key": env["PDROUTER_API_KEY"],
        "admin key": env["PDROUTER_ADMIN_KEY"],
        "internal secret": env["PDROUTER_INTERNAL_SECRET"],
    }


def test_secrets_travel_in_the_environment_and_a_0600_file_only(launched: Launched) -> None:
    secrets = _secrets(launched)
    assert secrets["api key"] == API_KEY and secrets["admin key"] == launched.admin_key
    assert min(len(s) for s in secrets.values()) >= 32
    for pid in launched.tree():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in cmdline, f"{_role(pid)} (pid {pid}) shows the {name}"
    key_file = launched.log_dir / ADMIN_KEY_FILE
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    output = launched.proc.log_tail(100_000)
    assert str(key_file) in output
    assert all(value not in output for value in secrets.values())
    assert "security: 7 Mooncake sockets have no authentication" in output
