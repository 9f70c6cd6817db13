"""`pdrouter launch`: a whole PD cluster on this host, supervised.

    mooncake_master ─► pool owner ─► prefill xN, decode xM, mixed xK ─► router

Each is a child process (its own session, stopped by PID) on a free loopback port; start-up
waits for every /health. Supervision: the master, the pool owner or the router dying stops
everything (exit 1, naming it); a worker dying is reported and restarted on the same port
(at most max_restarts times) while the router routes around it. Ctrl-C / SIGTERM stop all.
The router and the workers share an internal secret (random per cluster unless given), which
every child gets through its environment (PDROUTER_INTERNAL_SECRET), never on its command line.

`Cluster` is also what the demo, the benchmark and the end-to-end tests start.
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.cli_args import add_flag, env_name
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http


@dataclass(frozen=True)
class ClusterSpec:
    """What to start; ports 0 are picked free."""

    model: str = "tiny"
    num_prefill: int = 1
    num_decode: int = 1
    num_mixed: int = 0
    router_port: int = 0
    pool_size: str = "512MiB"
    worker_args: tuple[str, ...] = ()  # extra `pdworker serve` flags for every worker
    router_args: tuple[str, ...] = ()  # extra `pdrouter serve` flags
    env: tuple[tuple[str, str], ...] = (("OMP_NUM_THREADS", "1"), ("MC_LOG_LEVEL", "ERROR"))
    log_dir: str | None = None
    startup_timeout_s: float = 300.0
    max_restarts: int = 3
    api_key: str | None = None
    shared_memory: bool = True  # same-host workers reach the pool owner through shared memory
    # The router <-> worker secret on /internal/*; None: a fresh random one per cluster.
    internal_secret: str | None = None


@dataclass
class Child:
    """One supervised process and how to start it again."""

    name: str
    argv: list[str]
    health_url: str
    essential: bool  # dying stops the cluster (master, pool owner, router)
    proc: ManagedProcess | None = None
    restarts: int = 0
    log_path: Path | None = None


@dataclass
class Cluster:
    """Start, supervise and stop one PD cluster; a context manager."""

    spec: ClusterSpec
    log_dir: Path = field(init=False)
    children: list[Child] = field(default_factory=list)
    pool: object | None = None  # workers.pool.local_pool.LocalPool
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    mixed_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    pool_owner_url: str = ""
    master_admin_url: str = ""
    internal_secret: str = field(init=False)  # what the router sends and the workers require

    def __post_init__(self) -> None:
        self.log_dir = Path(self.spec.log_dir or tempfile.mkdtemp(prefix="pdrouter-launch-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.internal_secret = self.spec.internal_secret or secrets.token_urlsafe(32)

    # -- start ------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start everything and wait until healthy; on any failure stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from workers.pool.local_pool import LocalPool
        from workers.pool.owner import parse_size_bytes

        pool = LocalPool(parse_size_bytes(self.spec.pool_size), log_dir=self.log_dir)
        self.pool = pool
        pool.start(timeout_s=self.spec.startup_timeout_s)
        addrs = pool.addresses
        self.pool_owner_url = addrs.owner_url
        self.master_admin_url = addrs.admin_url
        pool_flags = ["--master", addrs.master_addr, "--metadata", addrs.metadata_url]
        if self.spec.shared_memory:
            pool_flags += ["--pool-owner", addrs.owner_addr]
        py = sys.executable
        workers: list[Child] = []
        for role, count, urls in (
            ("prefill", self.spec.num_prefill, self.prefill_urls),
            ("decode", self.spec.num_decode, self.decode_urls),
            ("mixed", self.spec.num_mixed, self.mixed_urls),
        ):
            for i in range(count):
                port = find_free_port()
                url = f"http://127.0.0.1:{port}"
                argv = [py, "-m", "workers.cli", "serve", "--role", role,
                        "--model", self.spec.model, "--port", str(port)]  # fmt: skip
                if role != "mixed":
                    argv += pool_flags
                argv += list(self.spec.worker_args)
                urls.append(url)
                workers.append(Child(f"{role}-{i}", argv, url + "/health", False))
                self._spawn(workers[-1])
        self._wait(workers)
        if not self.prefill_urls or not self.decode_urls:
            return  # mixed workers only: nothing to route
        router_port = self.spec.router_port or find_free_port()
        self.router_url = f"http://127.0.0.1:{router_port}"
        router_argv = [py, "-m", "pdrouter.cli", "serve", "--port", str(router_port),
                       "--prefill", *self.prefill_urls, "--decode", *self.decode_urls]  # fmt: skip
        if self.spec.api_key:
            router_argv += ["--api-key", self.spec.api_key]
        router_argv += list(self.spec.router_args)
        self._spawn(Child("router", router_argv, self.router_url + "/health", True))
        self._wait([self.children[-1]])

    def _spawn(self, child: Child) -> None:
        if child not in self.children:
            self.children.append(child)
        child.log_path = self.log_dir / f"{child.name}.log"
        # The secret goes through the environment (flag mirror), not argv, which `ps` shows.
        env = {**dict(self.spec.env), env_name("--internal-secret"): self.internal_secret}
        child.proc = ManagedProcess(child.name, child.argv, env=env, log_path=child.log_path)

    def _wait(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for child in children:
            wait_for_http(child.health_url, max(1.0, deadline - time.monotonic()), proc=child.proc)

    # -- supervise --------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """One line per process: name, pid, health URL (what an operator needs to find it)."""
        lines = []
        if self.pool is not None:
            pool = self.pool  # type: ignore[attr-defined]
            lines.append(f"mooncake_master  pid {pool.master.proc.pid:<7} {pool.master.admin_url}")
            lines.append(f"pool-owner       pid {pool.owner.pid:<7} {pool.addresses.owner_url}")
        for child in self.children:
            pid = child.proc.pid if child.proc is not None else "-"
            lines.append(
                f"{child.name:<16} pid {pid:<7} {child.health_url.removesuffix('/health')}"
            )
        return lines

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def check(self, report=print) -> str | None:
        """One supervision pass: restart dead workers; the name of a dead essential, or None."""
        if self.pool is not None:
            if not self.pool.master.alive():  # type: ignore[attr-defined]
                return "mooncake_master"
            owner = self.pool.owner  # type: ignore[attr-defined]
            if owner is not None and not owner.alive():
                return f"pool owner (exit code {owner.returncode})"
        for child in self.children:
            if child.proc is None or child.proc.alive():
                continue
            code = child.proc.returncode
            if child.essential:
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

    def supervise(self, stop: threading.Event, interval_s: float = 0.5, report=print) -> int:
        """Poll until stop is set (0) or an essential process dies (1)."""
        while not stop.wait(interval_s):
            dead = self.check(report)
            if dead is not None:
                report(f"{dead} died: stopping the cluster")
                return 1
        return 0

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the router first, then workers, pool owner, master; safe to call twice."""
        for child in reversed(self.children):
            if child.proc is not None:
                child.proc.stop(timeout_s=10.0)
        if self.pool is not None:
            self.pool.stop()  # type: ignore[attr-defined]

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--prefill", type=int, default=1, help="prefill workers to start")
    add_flag(parser, "--decode", type=int, default=1, help="decode workers to start")
    add_flag(parser, "--mixed", type=int, default=0, help="mixed (colocated) workers to start")
    add_flag(
        parser, "--model", default="tiny", help="'tiny', 'demo' or a Hugging Face checkpoint folder"
    )
    add_flag(parser, "--port", type=int, default=8000, help="router port")
    add_flag(parser, "--pool-size", default="512MiB", help="KV pool memory of the pool owner")
    add_flag(
        parser,
        "--worker-args",
        default="",
        help="extra flags for every `pdworker serve`, e.g. '--block-size 16'",
    )
    add_flag(parser, "--router-args", default="", help="extra flags for `pdrouter serve`")
    add_flag(parser, "--api-key", default=None, help="API key the router requires")
    add_flag(
        parser,
        "--internal-secret",
        default=None,
        help="secret the router sends and the workers require on /internal/* (default: a "
        "random one per launch; children get it through their environment)",
    )
    add_flag(parser, "--log-dir", default=None, help="where child logs go (default: a temp dir)")
    add_flag(parser, "--max-restarts", type=int, default=3, help="restarts per dead worker")
    add_flag(
        parser,
        "--pool-tcp",
        action="store_true",
        help="workers reach the pool over TCP instead of same-host shared memory",
    )


def run(args: argparse.Namespace) -> int:
    spec = ClusterSpec(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_mixed=args.mixed,
        router_port=args.port,
        pool_size=args.pool_size,
        worker_args=tuple(shlex.split(args.worker_args)),
        router_args=tuple(shlex.split(args.router_args)),
        log_dir=args.log_dir,
        max_restarts=args.max_restarts,
        api_key=args.api_key,
        shared_memory=not args.pool_tcp,
        internal_secret=args.internal_secret,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not (spec.num_prefill and spec.num_decode) and not spec.num_mixed:
        print("pdrouter launch: nothing to serve; give --prefill N --decode M (both >= 1) "
              "or --mixed K", file=sys.stderr)  # fmt: skip
        return 2
    cluster = Cluster(spec)
    print(f"starting {spec.num_prefill} prefill, {spec.num_decode} decode, {spec.num_mixed} "
          f"mixed workers of {spec.model}; logs in {cluster.log_dir}", flush=True)  # fmt: skip
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdrouter launch: start-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        for line in cluster.describe():
            print(line, flush=True)
        auth = f" -H 'Authorization: Bearer {spec.api_key}'" if spec.api_key else ""
        model = args.model
        # Without a prefill/decode pair there is no router: serve from the first mixed worker.
        url = cluster.router_url or cluster.mixed_urls[0]
        what = "router" if cluster.router_url else "mixed worker (no router: no P/D pair)"
        print(f"\n{what} ready: {url}/v1  (Ctrl-C stops everything)\n", flush=True)
        print(f"curl -N {url}/v1/chat/completions -H 'Content-Type: "
              f"application/json'{auth} -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": "
              f"\"user\", \"content\": \"Hello\"}}], \"max_tokens\": 16, \"stream\": true}}'\n",
              flush=True)  # fmt: skip
        return cluster.supervise(stop, report=lambda m: print(m, flush=True))
    finally:
        cluster.stop()
        print("stopped", flush=True)
