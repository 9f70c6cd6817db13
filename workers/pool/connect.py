"""Everything a pool client checks before it lets Mooncake set up, and why.

Mooncake's setup() holds the GIL and, when the master is down, retries for about 90 s (4 s with
MC_STORE_CLIENT_SETUP_RETRIES=1) before answering a bare -1. A few millisecond-scale probes
first turn the common mistakes (nothing listening, a typo in a port, a URL without a scheme)
into a PoolSetupError naming the flag or process to fix.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

from workers.pool.errors import PoolSetupError

PROBE_TIMEOUT_S = 1.0
INSTALL_HINT = (
    "pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1' (CPU hosts) or "
    "'mooncake-transfer-engine==0.3.13.post1' (CUDA hosts), and the Debian packages "
    "libibverbs1 librdmacm1"
)


def import_store() -> type:
    """MooncakeDistributedStore, imported lazily so that control-plane code never needs it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise PoolSetupError(f"cannot import mooncake.store ({exc}): {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def store_env(transfer_timeout_s: int) -> dict[str, str]:
    """Environment Mooncake reads at setup: fail fast instead of retrying for 90 s, bound
    reads from a hung owner, and keep its logging to errors."""
    return {
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
        "MC_TCP_STATUS_TIMEOUT_SEC": str(transfer_timeout_s),
        "MC_LOG_LEVEL": "ERROR",
    }


def parse_host_port(addr: str, flag: str) -> tuple[str, int]:
    """("host", port) from "host:port"; PoolSetupError naming flag otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PoolSetupError(f"{flag} must be HOST:PORT (e.g. 127.0.0.1:50051), got {addr!r}")
    return host, int(port)


def probe_tcp(host: str, port: int) -> str | None:
    """None when something accepts a connection at host:port, else the reason it failed."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def speaks_http(host: str, port: int) -> bool:
    """Whether host:port answers an HTTP GET (the master's RPC port just hangs up)."""
    import httpx

    try:
        httpx.get(f"http://{host}:{port}/", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return True


def preflight(master_addr: str, metadata_url: str, owner_addr: str | None) -> None:
    """Raise PoolSetupError naming the first address nothing answers on."""
    host, port = parse_host_port(master_addr, "--master")
    reason = probe_tcp(host, port)
    if reason:
        raise PoolSetupError(
            f"cannot reach the Mooncake master at {master_addr} ({reason}): start "
            "mooncake_master there, or fix --master / PDROUTER_MASTER"
        )
    if speaks_http(host, port):
        raise PoolSetupError(
            f"{master_addr} answers HTTP, so it is not the master's RPC port (the metadata or "
            "admin port?): pass the master's --rpc_port as --master / PDROUTER_MASTER"
        )
    url = urlparse(metadata_url)
    if url.scheme != "http" or not url.hostname or not url.port:
        raise PoolSetupError(
            f"--metadata must be the master's HTTP metadata URL, http://HOST:PORT/metadata, "
            f"got {metadata_url!r}"
        )
    reason = probe_tcp(url.hostname, url.port)
    if reason:
        raise PoolSetupError(
            f"cannot reach the metadata server at {metadata_url} ({reason}): start "
            "mooncake_master with --enable_http_metadata_server, or fix --metadata / "
            "PDROUTER_METADATA"
        )
    if owner_addr is not None:
        host, port = parse_host_port(owner_addr, "--pool-owner")
        reason = probe_tcp(host, port)
        if reason:
            raise PoolSetupError(
                f"cannot reach the pool owner at {owner_addr} ({reason}): start "
                "`pdworker pool`, or fix --pool-owner / PDROUTER_POOL_OWNER (or leave it "
                "unset to use TCP)"
            )
