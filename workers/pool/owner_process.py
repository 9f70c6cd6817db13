"""OwnerProcess: the wheel's `mooncake_client` child that mounts the pool memory.

OwnerProcess(OwnerConfig).start()  ─► mooncake_client --global_segment_size ... (a child
in the owner's process group, SIGKILLed by the kernel if the owner dies however it dies)
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

from pdrouter.common.flags import flag

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
    """What the owner mounts and where it listens (ports 0: pick free ones below 32768). The
    flags of `pdworker pool` are generated from these fields (pdrouter.common.flags)."""

    size_bytes: int = field(
        metadata=flag(
            "--size",
            "pool memory to mount, e.g. 2GiB, 512MiB",
            parse=parse_size_bytes,
            cli_default="2GiB",
            metavar="SIZE",
        )
    )
    master_addr: str = field(
        metadata=flag("--master", "Mooncake master HOST:PORT", required=True, metavar="HOST:PORT")
    )
    metadata_url: str = field(
        metadata=flag(
            "--metadata", "metadata URL http://HOST:PORT/metadata", required=True, metavar="URL"
        )
    )
    host: str = field(
        default="127.0.0.1", metadata=flag("--host", "address other clients reach us at")
    )
    http_port: int = field(
        default=0, metadata=flag("--port", "HTTP port for /health, /metrics (0: a free one)")
    )
    owner_port: int = field(
        default=0,
        metadata=flag(
            "--owner-port",
            "mooncake_client port; same-host workers pass HOST:this as "
            "--pool-owner (0: a free one)",
        ),
    )
    # 8, not 2: device-pointer gets run several calls at once (workers/pool/device_pool.py), and
    # with 2 service threads they queued: get 12.9 against 22.7 GB/s (docs/benchmarks/handoff.md).
    threads: int = field(default=8, metadata=flag("--threads", "mooncake_client service threads"))
    # /metrics and the detailed /health (pdrouter.common.doors.owner_door)
    admin_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--admin-key",
            "with it, /metrics and the detailed /health need 'Authorization: Bearer "
            "<key>' (set it through PDWORKER_ADMIN_KEY: argv is public)",
        ),
    )
    prefault: bool = field(
        default=True,
        metadata=flag(
            "--no-prefault",
            "skip writing the pool memory once at start (then the first puts "
            "fault it in page by page, several times slower; workers/pool/prefault.py)",
            negate=True,
        ),
    )


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the child when the owner dies, however it dies."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def owner_env(size_bytes: int, base: dict[str, str]) -> dict[str, str]:
    """base plus what the device-pointer path needs of the owner
    (docs/design/handoff_and_pool.md): same-host copies by memcpy (MC_STORE_MEMCPY=1: over
    CUDA IPC for a device pointer) into a segment page-locked whole
    (MC_STORE_PIN_MEMORY_MAX_BYTES at least its size: twice it, as measured; unpinned, device
    puts ran at 12 and gets at 5 GB/s). Mooncake's CPU wheel ignores both;
    set for every owner, so that a worker's start-up self-test (workers/pool/handoff_path.py)
    is all that decides."""
    pinned = max(2 * size_bytes, int(base.get("MC_STORE_PIN_MEMORY_MAX_BYTES", "0") or 0))
    return {**base, "MC_STORE_MEMCPY": "1", "MC_STORE_PIN_MEMORY_MAX_BYTES": str(pinned)}


class OwnerProcess:
    """The mooncake_client child: start it, check it, stop it."""

    def __init__(self, config: OwnerConfig) -> None:
        from pdrouter.common.proc import find_free_port

        self.config = config
        # The ports given by flag are bound later (the HTTP one only once the pool is up):
        # a port drawn here must not be one of them.
        given = {config.owner_port, config.http_port} - {0}
        self.owner_port = config.owner_port or find_free_port(avoid=given)
        self.child_http_port = find_free_port(avoid=given)
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
            self.argv(),
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            env=owner_env(self.config.size_bytes, dict(os.environ)),
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
