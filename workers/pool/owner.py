"""`pdworker pool`: the process that owns the pool memory, and nothing else.

    pdworker pool --size 2GiB --master HOST:PORT --metadata URL [--port N] [--owner-port N]

Workers mount no memory, so a worker crash loses no block; the memory lives here. The owner
runs the wheel's `mooncake_client` (the "real client") as its child: it mounts --size bytes
into the pool, serves TCP transfers to clients on any host, and serves same-host clients over
shared memory (KVPoolClient with owner_addr = HOST:owner-port). This process adds /health and
/metrics on --port and ties the child's life to its own:

    pdworker pool (HTTP /health /metrics) ── child ─► mooncake_client (--port owner-port)
        SIGTERM: stop the child, exit 0.  Child dies: exit 1.  Owner killed: child killed
        (same process group, and PR_SET_PDEATHSIG for a kill by PID alone).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pdrouter.common.cli_args import add_flag

log = logging.getLogger("pdworker.pool")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size_bytes(text: str) -> int:
    """Bytes in "2GiB", "512MiB", "1.5G", "64KiB" or "1048576" (powers of 1024 throughout)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


@dataclass(frozen=True)
class OwnerConfig:
    """What the owner mounts and where it listens (ports 0: pick free ones below 32768)."""

    size_bytes: int
    master_addr: str
    metadata_url: str
    host: str = "127.0.0.1"
    http_port: int = 0
    owner_port: int = 0
    threads: int = 2


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the child when the owner dies, however it dies."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


class OwnerProcess:
    """The mooncake_client child: start it, check it, stop it."""

    def __init__(self, config: OwnerConfig) -> None:
        from pdrouter.common.proc import find_free_port

        self.config = config
        self.owner_port = config.owner_port or find_free_port()
        self.child_http_port = find_free_port()
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def owner_addr(self) -> str:
        """HOST:PORT same-host clients pass as owner_addr (shared-memory path)."""
        return f"{self.config.host}:{self.owner_port}"

    def argv(self) -> list[str]:
        from workers.pool.master import find_binary

        c = self.config
        return [
            find_binary("mooncake_client"),
            f"--host={c.host}",
            f"--port={self.owner_port}",
            f"--global_segment_size={c.size_bytes}",
            f"--master_server_address={c.master_addr}",
            f"--metadata_server={c.metadata_url}",
            "--protocol=tcp",
            f"--threads={c.threads}",
            "--enable_http_server=true",
            f"--http_port={self.child_http_port}",
            "--minloglevel=1",
            "--logtostderr=true",
        ]

    def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start mooncake_client and wait for its /health; RuntimeError if it exits first."""
        import httpx

        from workers.pool.connect import preflight

        preflight(self.config.master_addr, self.config.metadata_url, None)
        # Same process group as this owner (no new session): killing the owner's group kills
        # the memory with it, as the failure tests expect.
        self.popen = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"mooncake_client exited with code {self.popen.returncode} before it was "
                    "ready (its log is above)"
                )
            try:
                if httpx.get(self.child_health_url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"mooncake_client not ready after {ready_timeout_s:.0f}s")

    @property
    def child_health_url(self) -> str:
        return f"http://127.0.0.1:{self.child_http_port}/health"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdworker pool` (each with a PDROUTER_* environment mirror)."""
    add_flag(parser, "--size", default="2GiB", help="pool memory to mount, e.g. 2GiB, 512MiB")
    add_flag(parser, "--master", required=True, help="Mooncake master HOST:PORT")
    add_flag(parser, "--metadata", required=True, help="metadata URL http://HOST:PORT/metadata")
    add_flag(parser, "--host", default="127.0.0.1", help="address other clients reach us at")
    add_flag(parser, "--port", type=int, default=0, help="HTTP port for /health, /metrics")
    add_flag(
        parser,
        "--owner-port",
        type=int,
        default=0,
        help="mooncake_client port; same-host workers pass HOST:this as --pool-owner",
    )
    add_flag(parser, "--threads", type=int, default=2, help="mooncake_client service threads")


def run(args: argparse.Namespace) -> int:
    """Mount the pool, serve /health and /metrics until SIGTERM/SIGINT or the child's death."""
    from workers.pool.errors import PoolSetupError
    from workers.pool.owner_http import serve_owner_http

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        size_bytes = parse_size_bytes(args.size)
    except ValueError as exc:
        print(f"pdworker pool: --size: {exc}", file=sys.stderr)
        return 2
    config = OwnerConfig(
        size_bytes=size_bytes,
        master_addr=args.master,
        metadata_url=args.metadata,
        host=args.host,
        http_port=args.port,
        owner_port=args.owner_port,
        threads=args.threads,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    owner = OwnerProcess(config)
    try:
        owner.start()
    except (PoolSetupError, RuntimeError, TimeoutError) as exc:
        owner.stop()
        print(f"pdworker pool: {exc}", file=sys.stderr)
        return 1
    server = serve_owner_http(owner, config.http_port)
    log.info(
        "pool owner up: %d bytes, owner_addr %s, http port %d",
        size_bytes,
        owner.owner_addr,
        server.server_address[1],
    )
    code = 0
    while not stop.wait(0.2):
        if not owner.alive():
            log.error("mooncake_client exited with %s; the pool is gone", owner.popen.returncode)  # type: ignore[union-attr]
            code = 1
            break
    server.shutdown()
    owner.stop()
    return code
