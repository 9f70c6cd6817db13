"""Cluster: a whole PD cluster on this host, started by command lines and supervised.

    pdworker metadata ─► pdworker master ─► pdworker pool
        ─► pdworker serve (prefill xN, decode xM, mixed xK) ─► pdrouter serve

Every process is a child started by its command line (pdrouter imports nothing of workers/),
in its own session, on a free port of spec.host, stopped by PID. The router's port (--port, or
one drawn) is held from the first step until the router is spawned: a port in use fails the
start at once, and nothing the cluster starts meanwhile can take it. Start-up waits for every
/health in that order. Supervision (check): the router dying is fatal (its name is returned).
Any other child that dies is started again with its own command line, so on the same ports (at
most max_restarts times each, every restart named in the log): a dead worker while the router
routes around it; a dead pool owner, master or metadata store while the workers recompute what
the pool would have held (their pool clients say degraded and reconnect to the new process at
the same address by themselves: workers/pool/pool_health.py). A master restart loses every
object in the pool; the owner mounts again by itself.

Children get explicit flags for everything the launcher decides (host, ports, model, pool
addresses): nothing reaches them through the launcher's own environment, whose PDROUTER_* and
PDWORKER_* variables are not passed on. The secrets (ClusterSecrets: API key, admin key,
internal secret) travel in the environment under each command's prefix, each only to the
children that use it, never on a command line; the admin key is also in LOG_DIR/admin_key.
When the router gets an --api-keys-file (spec.keys_file_mode), the workers start with
--router-only: only the internal secret (or --api-key) opens their doors.
A role that spec.cpu_affinity pins starts under taskset (pdrouter/launch/affinity.py).

`Cluster` is what `pdrouter launch`, the demo, the benchmarks and the end-to-end tests start.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.proc import ManagedProcess, find_free_port, hold_port, wait_for_http
from pdrouter.launch.affinity import pinned_argv
from pdrouter.launch.secrets import ClusterSecrets
from pdrouter.launch.spec import ClusterSpec, PoolEndpoints

ROUTER_PREFIX, WORKER_PREFIX = "PDROUTER_", "PDWORKER_"


@dataclass
class Child:
    """One supervised process and how to start it again."""

    name: str
    argv: list[str]
    health_url: str
    essential: bool  # needed to serve (router, master, pool owner): dying stops the cluster...
    env_prefix: str = WORKER_PREFIX  # the command's environment prefix (for its secret)
    # The ClusterSecrets fields this child gets (in its environment): the router and the
    # workers all three, the pool owner the admin key, the master and metadata store none.
    secrets: tuple[str, ...] = ("api_key", "admin_key", "internal_secret")
    proc: ManagedProcess | None = None
    restarts: int = 0
    log_path: Path | None = None
    # ...unless it may be restarted (the pool's processes); keyword-only: a positional
    # argument after `essential` is env_prefix, as the router's Child passes it
    restartable: bool = field(default=False, kw_only=True)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment a child starts with: the launcher's, minus every PDROUTER_*/PDWORKER_*
    variable (meant for the launcher, not for what it starts), plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith((ROUTER_PREFIX, WORKER_PREFIX))}
    env.update(extra)
    return env


@dataclass
class Cluster:
    """Start, supervise and stop one PD cluster; a context manager."""

    spec: ClusterSpec
    log_dir: Path = field(init=False)
    children: list[Child] = field(default_factory=list)
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    mixed_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    pool_addresses: PoolEndpoints | None = None
    secrets: ClusterSecrets = field(init=False, repr=False)
    admin_key_path: Path = field(init=False)  # LOG_DIR/admin_key, mode 0600
    _router_port_hold: socket.socket | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.log_dir = Path(self.spec.log_dir or tempfile.mkdtemp(prefix="pdrouter-launch-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = self.spec
        self.secrets = ClusterSecrets.create(spec.api_key, spec.admin_key, spec.internal_secret)
        self.admin_key_path = self.secrets.write_admin_key(self.log_dir)

    @property
    def internal_secret(self) -> str:
        """What the router sends and the workers require on /internal/*."""
        return self.secrets.internal_secret

    @property
    def admin_key(self) -> str:
        return self.secrets.admin_key

    @property
    def master_admin_url(self) -> str:
        return self.pool_addresses.admin_url if self.pool_addresses else ""

    # -- start ------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start everything and wait until healthy; on any failure stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _url(self, port: int) -> str:
        return f"http://{self.spec.host}:{port}"

    def _start(self) -> None:
        routed = bool(self.spec.num_prefill and self.spec.num_decode)
        router_port = 0
        if routed:
            # Held from now until the router is spawned: no process started meanwhile (a child
            # of ours, or anyone's probe for a free port) takes it, and a --port in use fails
            # here, before anything starts.
            router_port = self.spec.router_port or find_free_port()
            self._router_port_hold = hold_port(self.spec.host, router_port)
        pool = self._start_pool()
        self._start_workers(pool)
        if routed:  # mixed workers only: nothing to route
            self._start_router(router_port)

    def _start_pool(self) -> PoolEndpoints:
        """The metadata store, the master and the pool owner, each up before the next."""
        host, cli = self.spec.host, [sys.executable, "-m", "workers.cli"]
        rpc, meta, admin, owner, owner_http = (find_free_port() for _ in range(5))
        pool = PoolEndpoints(
            master_addr=f"{host}:{rpc}",
            metadata_url=f"{self._url(meta)}/metadata",
            owner_addr=f"{host}:{owner}",
            owner_url=self._url(owner_http),
            admin_url=self._url(admin),
        )
        self.pool_addresses = pool
        # The metadata store runs on its own, on host alone (the master's binds 0.0.0.0).
        metadata_argv = [*cli, "metadata", "--host", host, "--port", str(meta)]
        master_argv = [*cli, "master", "--host", host, "--rpc-port", str(rpc)]
        master_argv += ["--admin-port", str(admin)]
        meta_health, master_health = self._url(meta) + "/health", pool.admin_url + "/health"
        # Neither needs a secret: none reaches their environment.
        metadata = Child("metadata", metadata_argv, meta_health, True, restartable=True, secrets=())
        master = Child(
            "mooncake_master", master_argv, master_health, True, restartable=True, secrets=()
        )
        self._spawn(metadata)
        self._spawn(master)
        self._wait([metadata, master])
        owner_argv = [*cli, "pool", "--host", host, "--size", self.spec.pool_size]
        owner_argv += ["--master", pool.master_addr, "--metadata", pool.metadata_url]
        owner_argv += ["--port", str(owner_http), "--owner-port", str(owner)]
        owner_child = Child(
            "pool-owner",
            owner_argv,
            pool.owner_url + "/health",
            True,
            restartable=True,
            secrets=("admin_key",),
        )
        self._spawn(owner_child)
        self._wait([owner_child])
        return pool

    def _start_workers(self, pool: PoolEndpoints) -> None:
        workers: list[Child] = []
        for role, count, urls in (
            ("prefill", self.spec.num_prefill, self.prefill_urls),
            ("decode", self.spec.num_decode, self.decode_urls),
            ("mixed", self.spec.num_mixed, self.mixed_urls),
        ):
            for i in range(count):
                port = find_free_port()
                url = self._url(port)
                urls.append(url)
                argv = self._worker_argv(role, i, port, pool)
                workers.append(Child(f"{role}-{i}", argv, url + "/health", False))
                self._spawn(workers[-1])
        self._wait(workers)

    def _worker_argv(self, role: str, index: int, port: int, pool: PoolEndpoints) -> list[str]:
        """`pdworker serve` of worker `index` of `role`; --worker-args last, so they win."""
        spec = self.spec
        argv = [sys.executable, "-m", "workers.cli", "serve", "--role", role]
        argv += ["--host", spec.host, "--model", spec.model, "--port", str(port)]
        if role != "mixed":
            argv += ["--master", pool.master_addr, "--metadata", pool.metadata_url]
            if spec.shared_memory:
                argv += ["--pool-owner", pool.owner_addr]
        if spec.tp_size(role, index) > 1:
            argv += ["--tensor-parallel-size", str(spec.tp_size(role, index))]
        if spec.keys_file_mode:  # its keys' limits are the router's alone
            argv.append("--router-only")
        if spec.engine_backend:
            argv += ["--engine-backend", spec.engine_backend]
        if spec.device:
            argv += ["--device", spec.device]
        return argv + list(spec.worker_args)

    def _start_router(self, router_port: int) -> None:
        self.router_url = self._url(router_port)
        argv = [sys.executable, "-m", "pdrouter.cli", "serve", "--host", self.spec.host]
        argv += ["--port", str(router_port), "--prefill", *self.prefill_urls]
        argv += ["--decode", *self.decode_urls]
        if self.spec.api_keys_file:
            argv += ["--api-keys-file", str(Path(self.spec.api_keys_file).resolve())]
        argv += self.spec.router_args
        router = Child("router", argv, self.router_url + "/health", True, ROUTER_PREFIX)
        self._release_router_port()
        self._spawn(router)
        self._wait([router])

    def _release_router_port(self) -> None:
        if self._router_port_hold is not None:
            self._router_port_hold.close()
            self._router_port_hold = None

    def _spawn(self, child: Child) -> None:
        if child not in self.children:
            self.children.append(child)
        child.log_path = self.log_dir / f"{child.name}.log"
        # Secrets go through the environment (the flags' mirrors), not argv, which `ps` shows.
        secrets_env = self.secrets.env(child.secrets, child.env_prefix)
        env = child_env({**dict(self.spec.env), **secrets_env})
        argv = pinned_argv(child.argv, child.name, self.spec.cpu_affinity)
        child.proc = ManagedProcess(
            child.name, argv, env=env, log_path=child.log_path, inherit_env=False
        )

    def _wait(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for child in children:
            timeout_s = max(1.0, deadline - time.monotonic())
            self._wait_ready(child, timeout_s)

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        """Wait for child's /health. The router's must carry the router's pid (another server
        may hold its port, e.g. a --port already taken: its /health is not our router's); a
        keyed router shows its pid only to the admin key, so the wait sends it."""
        if child.name != "router" or child.proc is None:
            wait_for_http(child.health_url, timeout_s, proc=child.proc)
            return
        auth = {"Authorization": f"Bearer {self.secrets.admin_key}"}
        wait_for_http(
            child.health_url, timeout_s, proc=child.proc, pid=child.proc.pid, headers=auth
        )

    # -- supervise --------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """One line per process: name, pid, base URL (what an operator needs to find it)."""
        lines = []
        for child in self.children:
            pid = child.proc.pid if child.proc is not None else "-"
            lines.append(
                f"{child.name:<16} pid {pid:<7} {child.health_url.removesuffix('/health')}"
            )
        return lines

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a child again with its own command line (same ports) and wait for it."""
        child = self.child(name)
        if child.proc is not None:
            child.proc.stop()
        self._spawn(child)
        assert child.proc is not None
        self._wait_ready(child, timeout_s)

    def check(self, report=print) -> str | None:
        """One supervision pass: restart dead children (workers, the pool's processes); the
        name of a dead child that cannot be restarted (the router), or None."""
        for child in self.children:
            if child.proc is None or child.proc.alive():
                continue
            code = child.proc.returncode
            if child.essential and not child.restartable:
                return f"{child.name} (exit code {code})"
            if child.restarts >= self.spec.max_restarts:
                report(f"{child.name} died (exit code {code}); restart limit reached, left down")
                child.proc = None
                continue
            child.restarts += 1
            report(
                f"{child.name} died (exit code {code}); restarting "
                f"({child.restarts}/{self.spec.max_restarts}); log: {child.log_path}"
            )
            child.proc.stop()
            self._spawn(child)
        return None

    def supervise(self, stop, interval_s: float = 0.5, report=print) -> int:
        """Poll until stop (a threading.Event) is set (0) or an essential process dies (1)."""
        while not stop.wait(interval_s):
            dead = self.check(report)
            if dead is not None:
                report(f"{dead} died: stopping the cluster")
                return 1
        return 0

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the router first, then workers, pool owner, master; safe to call twice."""
        self._release_router_port()
        for child in reversed(self.children):
            if child.proc is not None:
                child.proc.stop(timeout_s=10.0)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
