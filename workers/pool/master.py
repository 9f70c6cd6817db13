"""MooncakeMaster: start the wheel's `mooncake_master` on free loopback ports, wait, stop.

The master keeps the pool's metadata (which key lives where) and, with
--enable_http_metadata_server, also serves the transfer engine's metadata over HTTP, so one
process is all a single host needs (no etcd). Three ports:

    rpc_port       clients' master address    (--master HOST:PORT)
    metadata_port  http://HOST:PORT/metadata  (--metadata URL)
    admin_port     Prometheus /metrics, /health, /get_all_keys, /query_key
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.flags import flag
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http

BINARY = "mooncake_master"


def find_binary(name: str) -> str:
    """Path of a binary the mooncake wheel installs; RuntimeError naming what to install."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError as exc:
        raise RuntimeError(
            f"{name} not found: install the Mooncake wheel, "
            "pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1' (or the CUDA build)"
        ) from exc
    in_package = Path(mooncake.__file__).parent / name
    if in_package.exists():
        return str(in_package)
    raise RuntimeError(
        f"{name} not found beside {sys.executable}, on PATH, or in {in_package.parent}"
    )


@dataclass(frozen=True)
class MasterConfig:
    """Master settings; 0 for a port means pick a free one below 32768.

    Defaults are the values measured to keep failures quick on one host: a dead client's
    segment is dropped after client_ttl_s; a crashed writer's half-written keys read as
    not-ready until put_discard_timeout_s (then a new put may take them over) and hold their
    space until put_release_timeout_s; a reader's lease blocks eviction/removal for
    lease_ttl_ms.
    """

    host: str = field(default="127.0.0.1", metadata=flag("--host", "address every port binds"))
    rpc_port: int = field(
        default=0, metadata=flag("--rpc-port", "clients' master port", required=True)
    )
    metadata_port: int = field(
        default=0,
        metadata=flag(
            "--metadata-port",
            "embedded HTTP metadata port (binds 0.0.0.0 whatever --host says); "
            "0: none, run `pdworker metadata`",
        ),
    )
    admin_port: int = field(
        default=0, metadata=flag("--admin-port", "/health, /metrics, /get_all_keys", required=True)
    )
    lease_ttl_ms: int = field(
        default=5000,
        metadata=flag("--lease-ttl-ms", "how long a reader's lease keeps an object from eviction"),
    )
    client_ttl_s: int = field(
        default=2,
        metadata=flag("--client-ttl-s", "a silent client's memory is dropped after this long"),
    )
    put_discard_timeout_s: int = field(
        default=2,
        metadata=flag(
            "--put-discard-timeout-s",
            "a crashed writer's keys may be written again after this long",
        ),
    )
    put_release_timeout_s: int = field(
        default=30,
        metadata=flag(
            "--put-release-timeout-s", "a crashed writer's space comes back after this long"
        ),
    )
    eviction_high_watermark_ratio: float = 0.9
    log_level: int = field(
        default=1, metadata=flag("--log-level", "glog minloglevel: 0 info, 1 warning, 2 error")
    )


def master_argv(c: MasterConfig, rpc_port: int, metadata_port: int, admin_port: int) -> list[str]:
    """mooncake_master's command line with the project's settings (MasterConfig).

    metadata_port 0: no embedded metadata server (it binds 0.0.0.0 whatever its host flag
    says); `pdworker metadata` serves the store on the host alone instead."""
    metadata = ["--enable_http_metadata_server=false"]
    if metadata_port:
        metadata = [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={c.host}",
            f"--http_metadata_server_port={metadata_port}",
        ]
    return [
        find_binary(BINARY),
        f"--rpc_address={c.host}",
        f"--rpc_port={rpc_port}",
        *metadata,
        f"--metrics_host={c.host}",
        f"--metrics_port={admin_port}",
        f"--default_kv_lease_ttl={c.lease_ttl_ms}",
        f"--client_ttl={c.client_ttl_s}",
        f"--put_start_discard_timeout_sec={c.put_discard_timeout_s}",
        f"--put_start_release_timeout_sec={c.put_release_timeout_s}",
        f"--eviction_high_watermark_ratio={c.eviction_high_watermark_ratio}",
        f"--minloglevel={c.log_level}",
        "--logtostderr=true",
    ]


class MooncakeMaster:
    """One mooncake_master child process; use as a context manager or start()/stop()."""

    def __init__(self, config: MasterConfig | None = None, log_dir: Path | None = None) -> None:
        config = config if config is not None else MasterConfig()
        self.config = config
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="pdpool-master-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proc: ManagedProcess | None = None
        self.rpc_port = config.rpc_port
        self.metadata_port = config.metadata_port
        self.admin_port = config.admin_port

    @property
    def master_addr(self) -> str:
        """HOST:PORT clients pass as master_server_addr (`--master`)."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server URL clients pass as metadata_server (`--metadata`)."""
        return f"http://{self.config.host}:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        """Base URL of the admin server (/metrics, /health, /get_all_keys)."""
        return f"http://{self.config.host}:{self.admin_port}"

    def _argv(self) -> list[str]:
        return master_argv(self.config, self.rpc_port, self.metadata_port, self.admin_port)

    def start(
        self, timeout_s: float = 30.0, attempts: int = 3, keep_ports: bool = False
    ) -> MooncakeMaster:
        """Start and wait until all three ports answer; retries on a port lost to a race.
        keep_ports: again on the ports of the last start (a restart clients find again)."""
        if self.proc is not None and self.proc.alive():
            return self
        if keep_ports and self.rpc_port:
            self.config = dataclasses.replace(
                self.config,
                rpc_port=self.rpc_port,
                metadata_port=self.metadata_port,
                admin_port=self.admin_port,
            )
        last_error: Exception | None = None
        for attempt in range(attempts):
            c = self.config
            self.rpc_port = c.rpc_port or find_free_port()
            self.metadata_port = c.metadata_port or find_free_port()
            self.admin_port = c.admin_port or find_free_port()
            log_path = self.log_dir / f"mooncake_master.{attempt}.log"
            self.proc = ManagedProcess("mooncake_master", self._argv(), log_path=log_path)
            try:
                self._wait_ready(timeout_s)
                return self
            except (RuntimeError, TimeoutError) as exc:
                last_error = exc
                self.proc.stop()
                if c.rpc_port and c.metadata_port and c.admin_port:
                    break  # fixed ports: a retry would fail the same way
        raise RuntimeError(f"mooncake_master did not start: {last_error}")

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        wait_for_http(self.admin_url + "/health", timeout_s, proc=self.proc)
        for port in (self.rpc_port, self.metadata_port):
            while not _port_open(self.config.host, port):
                if not self.proc.alive():
                    raise RuntimeError(
                        f"mooncake_master exited ({self.proc.returncode}): {self.proc.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mooncake_master port {port} not open after {timeout_s}s")
                time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bound; safe to call twice."""
        if self.proc is not None:
            self.proc.stop(timeout_s=5.0)

    def kill(self) -> None:
        """SIGKILL now (fault injection: the master crashes)."""
        if self.proc is not None:
            self.proc.kill()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
