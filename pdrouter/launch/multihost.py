"""A PD cluster spread over the simulated hosts of pdrouter.launch.netns, by command line only.

    hostA  mooncake master (RPC, admin), metadata store     pool owner a (its memory)
    hostB  pool owner b (its memory)                        prefill worker
    hostC  decode worker                                    mixed worker (the colocated reference)
    hostD  router r0 :8000, router r1 :8001
    client the caller's HTTP calls (tests/e2e/multihost, benchmarks.pd_multihost)

Every process binds its own host's address; the workers reach the pool over TCP (no
--pool-owner: that is the same-host shared-memory path) and advertise their host's address to
Mooncake (--pool-hostname). Each worker registers with both routers (--router twice). Every
process but the mixed reference is started by examples/start_host.sh ROLE, as docs/deploy.md
tells an operator to; each host has its own port space, so the ports are the script's fixed
ones (PORTS). The script is read from the source checkout this module lives in (START_HOST):
this rehearses a deployment from a checkout, it is not part of what the wheel installs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.proc import ManagedProcess, wait_for_http
from pdrouter.launch.netns import Topology

START_HOST = Path(__file__).resolve().parents[2] / "examples" / "start_host.sh"
HOSTS = ("hostA", "hostB", "hostC", "hostD")
PORTS = {
    "master_rpc": 50051,
    "metadata": 8080,
    "master_admin": 9003,
    "owner_http": 8090,
    "owner": 17000,
    "worker": 8100,
    "mixed": 8200,
    "r0": 8000,
    "r1": 8001,
}
ADMIN_KEY = "multihost-admin"
SECRET = "multihost-secret"
HEARTBEAT_TTL_S = 4.0
ENV = {"OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
# Where each named process runs.
PLACEMENT = {
    "master": "hostA",
    "metadata": "hostA",
    "owner-a": "hostA",
    "owner-b": "hostB",
    "prefill": "hostB",
    "decode": "hostC",
    "mixed": "hostC",
    "r0": "hostD",
    "r1": "hostD",
}


@dataclass(frozen=True)
class PoolAddresses:
    master_addr: str  # workers' and owners' --master
    metadata_url: str  # their --metadata
    admin_url: str  # /metrics, /get_all_keys, /query_key


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str]  # on top of the caller's environment and ENV


def start_host(role: str, address: str, env: dict[str, str], extra: Sequence[str] = ()) -> Command:
    """One host's share, started as an operator would: examples/start_host.sh ROLE."""
    if not START_HOST.is_file():
        raise FileNotFoundError(f"{START_HOST} missing: run from a source checkout of pdrouter")
    return Command(
        ["bash", str(START_HOST), role, *extra], {"PY": sys.executable, "HOST_ADDR": address, **env}
    )


def master_commands(address: str) -> tuple[list[tuple[str, Command]], PoolAddresses]:
    """The host-A processes that make the pool's control plane, and how clients reach them.

    `pdworker master` runs mooncake_master without its built-in HTTP metadata server (which
    binds every interface whatever it is told); `pdworker metadata` serves the store on the
    host's address alone (roles `master` and `metadata` of start_host.sh). The rest of the
    cluster uses the PoolAddresses this returns.
    """
    pool = PoolAddresses(
        master_addr=f"{address}:{PORTS['master_rpc']}",
        metadata_url=f"http://{address}:{PORTS['metadata']}/metadata",
        admin_url=f"http://{address}:{PORTS['master_admin']}",
    )
    commands = [
        ("master", start_host("master", address, {})),
        ("metadata", start_host("metadata", address, {})),
    ]
    return commands, pool


def router_command(address: str, port: int) -> Command:
    env = {"ADMIN_KEY": ADMIN_KEY, "INTERNAL_SECRET": SECRET, "PORT": str(port)}
    return start_host(
        "router",
        address,
        env,
        [
            "--health-interval-s",
            "0.3",
            "--heartbeat-ttl-s",
            str(HEARTBEAT_TTL_S),
            "--unhealthy-after",
            "2",
            "--healthy-after",
            "1",
            # every prompt through P and the pool across hosts, which is what the
            # multihost tests and benchmark follow (no prefill on D)
            "--local-prefill-below-tokens",
            "0",
        ],
    )


def owner_command(address: str, master_address: str, size: str) -> Command:
    env = {"MASTER_ADDR": master_address, "POOL_SIZE": size, "PORT": str(PORTS["owner_http"])}
    return start_host("pool", address, env)


def worker_command(
    role: str,
    address: str,
    master_address: str,
    router_urls: Sequence[str],
    model: str,
    engine_args: Sequence[str],
) -> Command:
    if role == "mixed":  # the colocated reference: no pool, no router (not a script role)
        return Command(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "serve",
                "--role",
                "mixed",
                "--model",
                model,
                "--host",
                address,
                "--port",
                str(PORTS["mixed"]),
                *engine_args,
            ],
            {},
        )
    env = {
        "MASTER_ADDR": master_address,
        "ROUTERS": ",".join(router_urls),
        "MODEL": model,
        "ADMIN_KEY": ADMIN_KEY,
        "INTERNAL_SECRET": SECRET,
        "PORT": str(PORTS["worker"]),
    }
    return start_host(role, address, env, [*engine_args, "--heartbeat-interval-s", "0.5"])


@dataclass
class MultiHostCluster:
    """The processes of the topology, by name (PLACEMENT); restart(name) starts one again."""

    topo: Topology
    log_dir: Path
    model: str  # --model of every worker
    engine_args: tuple[str, ...]  # more worker flags (KV blocks, block size, ...)
    pool_size: str = "64MiB"
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    pool: PoolAddresses | None = None
    _commands: dict[str, Command] = field(default_factory=dict)
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
        ready = {
            "master": f"{pool.admin_url}/health",
            "metadata": f"{pool.metadata_url.removesuffix('/metadata')}/health",
        }
        for name, command in commands:
            self._commands[name] = command
            self._ready_urls[name] = (ready[name], 200)
        master = self.address("master")
        for name in ("owner-a", "owner-b"):
            self._commands[name] = owner_command(self.address(name), master, self.pool_size)
            owner_url = f"http://{self.address(name)}:{PORTS['owner_http']}"
            self._ready_urls[name] = (f"{owner_url}/health", 200)
        for name in ("r0", "r1"):
            self._commands[name] = router_command(self.address(name), PORTS[name])
            self._ready_urls[name] = (f"{self.url(name)}/instances", 401)  # up, needs the key
        for name in ("prefill", "decode", "mixed"):
            self._commands[name] = worker_command(
                name, self.address(name), master, self.router_urls, self.model, self.engine_args
            )
            self._ready_urls[name] = (f"{self.url(name)}/health", 200)

    def start(self, timeout_s: float = 240.0) -> MultiHostCluster:
        """Pool first (owners need the master), then routers and workers together."""
        self._plan()
        for group in (["master", "metadata"], ["owner-a", "owner-b"], ["r0", "r1"]):
            self._start_all(group, timeout_s)
        self._start_all(["prefill", "decode", "mixed"], timeout_s)
        return self

    def _start_all(self, names: list[str], timeout_s: float) -> None:
        for name in names:
            self._spawn(name)
        for name in names:
            self.wait_ready(name, timeout_s)

    def _spawn(self, name: str) -> None:
        host, command = self.topo[PLACEMENT[name]], self._commands[name]
        self.procs[name] = ManagedProcess(
            name,
            host.argv(command.argv),
            env={**ENV, **command.env},
            log_path=self.log_dir / f"{name}.log",
        )

    def wait_ready(self, name: str, timeout_s: float = 240.0) -> None:
        url, status = self._ready_urls[name]
        self.topo.call(wait_for_http, url, timeout_s, self.procs[name], status)

    def restart(self, name: str, timeout_s: float = 240.0) -> None:
        """Start name again on its host (after the caller stopped or killed it)."""
        self.procs[name].stop()
        self._spawn(name)
        self.wait_ready(name, timeout_s)

    def call(self, fn: Callable[..., object], *args: object) -> object:
        return self.topo.call(fn, *args)

    def stop(self) -> None:
        """Every process by PID, workers and routers first; the pool last."""
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
