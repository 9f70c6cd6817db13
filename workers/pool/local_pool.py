"""LocalPool: a master and a pool owner on this host, started and stopped as one unit.

The tests and the benchmarks need the same thing: a mooncake_master with its HTTP metadata
server, then `pdworker pool` mounting the memory, each on free loopback ports, each stopped by
PID. PoolAddresses is all a worker needs to connect. (`pdrouter launch` starts the same
processes by their command lines instead, pdrouter.launch.cluster: the launcher imports nothing
of workers/.)
"""

from __future__ import annotations

import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from workers.pool.master import MasterConfig, MooncakeMaster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolAddresses:
    """Addresses of a running pool.

    master_addr / metadata_url: every client (`--master`, `--metadata`).
    owner_addr: same-host clients that want shared memory (`--pool-owner`); None means TCP.
    owner_url: the owner's /health and /metrics.  admin_url: the master's /metrics etc.
    """

    master_addr: str
    metadata_url: str
    owner_addr: str
    owner_url: str
    admin_url: str


class LocalPool:
    """mooncake_master + `pdworker pool --size size_bytes`, on 127.0.0.1."""

    def __init__(
        self,
        size_bytes: int,
        log_dir: Path | None = None,
        master_config: MasterConfig | None = None,
        owner_threads: int = 8,
        prefault: bool = True,
    ) -> None:
        self.size_bytes = size_bytes
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="pdpool-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.master = MooncakeMaster(master_config or MasterConfig(), log_dir=self.log_dir)
        self.owner_threads = owner_threads
        self.prefault = prefault  # False: `pdworker pool --no-prefault` (a cold pool)
        self.owner: ManagedProcess | None = None
        self.owner_port = 0
        self.owner_http_port = 0

    @property
    def addresses(self) -> PoolAddresses:
        return PoolAddresses(
            master_addr=self.master.master_addr,
            metadata_url=self.master.metadata_url,
            owner_addr=f"127.0.0.1:{self.owner_port}",
            owner_url=f"http://127.0.0.1:{self.owner_http_port}",
            admin_url=self.master.admin_url,
        )

    def start(self, timeout_s: float = 60.0) -> LocalPool:
        """Start the master (if not running) and the owner; wait until both are healthy."""
        if not self.master.alive():
            self.master.start()
        self.start_owner(timeout_s)
        return self

    def start_owner(
        self, timeout_s: float = 60.0, attempts: int = 3, keep_ports: bool = False
    ) -> None:
        """(Re)start the owner against the running master: new ports (keep_ports: the same
        ones, as the launcher does, so that connected clients find the new owner), empty memory.

        An owner that exits before it is ready is started again on fresh ports, up to
        `attempts` times: its ports are picked free but taken only when it binds them, and
        another process may bind one first (seen once in a full test run, exit code 1 right
        after mounting). A real misconfiguration fails every attempt and is raised.
        """
        for attempt in range(1, attempts + 1):
            try:
                self._start_owner_once(timeout_s, keep_ports and attempt == 1)
                return
            except RuntimeError as exc:  # exited before ready (a timeout is TimeoutError)
                if attempt == attempts:
                    raise
                log.warning("pool owner exited before it was ready (%s); retrying", exc)

    def _start_owner_once(self, timeout_s: float, keep_ports: bool = False) -> None:
        if self.owner is not None:
            self.owner.stop()
        if not (keep_ports and self.owner_port):
            self.owner_port = find_free_port()
            self.owner_http_port = find_free_port()
        argv = [
            sys.executable,
            "-m",
            "workers.cli",
            "pool",
            f"--size={self.size_bytes}",
            f"--master={self.master.master_addr}",
            f"--metadata={self.master.metadata_url}",
            f"--port={self.owner_http_port}",
            f"--owner-port={self.owner_port}",
            f"--threads={self.owner_threads}",
            *([] if self.prefault else ["--no-prefault"]),
        ]
        self.owner = ManagedProcess(
            "pdworker pool",
            argv,
            env={"MC_LOG_LEVEL": "ERROR"},
            log_path=self.log_dir / "owner.log",
        )
        try:
            wait_for_http(self.addresses.owner_url + "/health", timeout_s, proc=self.owner)
        except BaseException:
            self.owner.stop()
            raise

    def stop(self) -> None:
        """Stop the owner, then the master; safe to call twice."""
        if self.owner is not None:
            self.owner.stop()
        self.master.stop()

    def __enter__(self) -> LocalPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
