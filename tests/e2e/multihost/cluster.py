"""A PD cluster spread over the simulated hosts of netns.py, started by command line only.

    hostA  mooncake master (RPC, HTTP metadata, admin)     pool owner a (its memory)
    hostB  pool owner b (its memory)                        prefill worker
    hostC  decode worker                                    mixed worker (the colocated reference)
    hostD  router r0 :8000, router r1 :8001
    client the tests' HTTP calls

Every process binds its own host's address; the workers reach the pool over TCP (no
--pool-owner: that is the same-host shared-memory path) and advertise their host's address to
Mooncake (--pool-hostname). Each worker registers with both routers (--router twice). The same
commands, one host at a time, are what examples/start_host.sh runs and docs/deploy.md lists.
Each host has its own port space, so the ports are fixed (PORTS).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.proc import ManagedProcess, wait_for_http
from tests.e2e.multihost.netns import Topology

HOSTS = ("hostA", "hostB", "hostC", "hostD")
PORTS = {"master_rpc": 50051, "metadata": 8080, "master_admin": 9003, "owner_http": 8090,
         "owner": 17000, "worker": 8100, "mixed": 8200, "r0": 8000, "r1": 8001}  # fmt: skip
ADMIN_KEY = "multihost-admin"
SECRET = "multihost-secret"
HEARTBEAT_TTL_S = 4.0
ENV = {"OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
# Where each named process runs.
PLACEMENT = {"master": "hostA", "owner-a": "hostA", "owner-b": "hostB", "prefill": "hostB",
             "decode": "hostC", "mixed": "hostC", "r0": "hostD", "r1": "hostD"}  # fmt: skip


@dataclass(frozen=True)
class PoolAddresses:
    master_addr: str  # workers' and owners' --master
    metadata_url: str  # their --metadata
    admin_url: str  # /metrics, /get_all_keys, /query_key


def master_commands(address: str) -> tuple[list[tuple[str, list[str]]], PoolAddresses]:
    """The host-A processes that make the pool's control plane, and how clients reach them.

    Today `pdworker master` runs mooncake_master with its built-in HTTP metadata server (one
    process). Where the metadata server becomes a process of its own, only this function
    changes: the rest of the cluster uses the PoolAddresses it returns.
    """
    argv = [sys.executable, "-m", "workers.cli", "master", "--host", address,
            "--rpc-port", str(PORTS["master_rpc"]), "--metadata-port", str(PORTS["metadata"]),
            "--admin-port", str(PORTS["master_admin"])]  # fmt: skip
    pool = PoolAddresses(
        master_addr=f"{address}:{PORTS['master_rpc']}",
        metadata_url=f"http://{address}:{PORTS['metadata']}/metadata",
        admin_url=f"http://{address}:{PORTS['master_admin']}",
    )
    return [("master", argv)], pool


def owner_argv(address: str, pool: PoolAddresses, size: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", "pool", "--size", size,
            "--master", pool.master_addr, "--metadata", pool.metadata_url, "--host", address,
            "--port", str(PORTS["owner_http"]), "--owner-port", str(PORTS["owner"])]  # fmt: skip


def router_argv(address: str, port: int) -> list[str]:
    return [sys.executable, "-m", "pdrouter.cli", "serve", "--host", address,
            "--port", str(port), "--admin-key", ADMIN_KEY, "--internal-secret", SECRET,
            "--health-interval-s", "0.3", "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S),
            "--unhealthy-after", "2", "--healthy-after", "1"]  # fmt: skip


def worker_argv(role: str, address: str, port: int, pool: PoolAddresses,
                router_urls: Sequence[str], model_args: Sequence[str]) -> list[str]:  # fmt: skip
    argv = [sys.executable, "-m", "workers.cli", "serve", "--role", role, "--host", address,
            "--port", str(port), *model_args, "--internal-secret", SECRET]  # fmt: skip
    if role == "mixed":
        return argv
    routers = [flag for url in router_urls for flag in ("--router", url)]
    return [*argv, "--master", pool.master_addr, "--metadata", pool.metadata_url,
            "--pool-hostname", address, *routers, "--admin-key", ADMIN_KEY,
            "--heartbeat-interval-s", "0.5"]  # fmt: skip


@dataclass
class MultiHostCluster:
    """The processes of the topology, by name (PLACEMENT); start(name) (re)starts one."""

    topo: Topology
    log_dir: Path
    model_args: tuple[str, ...]
    pool_size: str = "64MiB"
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    pool: PoolAddresses | None = None
    _argvs: dict[str, list[str]] = field(default_factory=dict)
    _ready_urls: dict[str, tuple[str, int]] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return self.topo[PLACEMENT[name]].address

    def url(self, name: str) -> str:
        port = {"prefill": "worker", "decode": "worker"}.get(name, name)
        return f"http://{self.address(name)}:{PORTS[port]}"

    @property
    def router_urls(self) -> list[str]:
        return [self.url("r0"), self.url("r1")]

    def _plan(self) -> None:
        commands, pool = master_commands(self.address("master"))
        self.pool = pool
        for name, argv in commands:
            self._argvs[name] = argv
            self._ready_urls[name] = (f"{pool.admin_url}/health", 200)
        for name in ("owner-a", "owner-b"):
            self._argvs[name] = owner_argv(self.address(name), pool, self.pool_size)
            owner_url = f"http://{self.address(name)}:{PORTS['owner_http']}"
            self._ready_urls[name] = (f"{owner_url}/health", 200)
        for name in ("r0", "r1"):
            self._argvs[name] = router_argv(self.address(name), PORTS[name])
            self._ready_urls[name] = (f"{self.url(name)}/instances", 401)  # up, needs the key
        for name in ("prefill", "decode", "mixed"):
            port = PORTS["mixed" if name == "mixed" else "worker"]
            self._argvs[name] = worker_argv(name, self.address(name), port, pool,
                                            self.router_urls, self.model_args)  # fmt: skip
            self._ready_urls[name] = (f"{self.url(name)}/health", 200)

    def start(self, timeout_s: float = 240.0) -> MultiHostCluster:
        """Pool first (owners need the master), then routers and workers together."""
        self._plan()
        for group in (["master"], ["owner-a", "owner-b"], ["r0", "r1"]):
            self._start_all(group, timeout_s)
        self._start_all(["prefill", "decode", "mixed"], timeout_s)
        return self

    def _start_all(self, names: list[str], timeout_s: float) -> None:
        for name in names:
            self._spawn(name)
        for name in names:
            self.wait_ready(name, timeout_s)

    def _spawn(self, name: str) -> None:
        host = self.topo[PLACEMENT[name]]
        self.procs[name] = ManagedProcess(name, host.argv(self._argvs[name]), env=ENV,
                                          log_path=self.log_dir / f"{name}.log")  # fmt: skip

    def wait_ready(self, name: str, timeout_s: float = 240.0) -> None:
        url, status = self._ready_urls[name]
        self.topo.call(wait_for_http, url, timeout_s, self.procs[name], status)

    def restart(self, name: str, timeout_s: float = 240.0) -> None:
        """Start name again on its host (after a test stopped or killed it)."""
        self.procs[name].stop()
        self._spawn(name)
        self.wait_ready(name, timeout_s)

    def call(self, fn: Callable[..., object], *args: object) -> object:
        return self.topo.call(fn, *args)

    def stop(self) -> None:
        """Every process by PID, workers and routers first; the pool last."""
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
