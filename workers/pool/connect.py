"""Connecting a pool client: the checks before Mooncake's setup, the setup, and the probes
that name the real cause of a failure afterwards.

Mooncake's setup() holds the GIL and, when the master is down, retries for about 90 s (4 s with
MC_STORE_CLIENT_SETUP_RETRIES=1) before answering a bare -1. A few millisecond-scale probes
first turn the common mistakes (nothing listening, a typo in a port, a URL without a scheme)
into a PoolSetupError naming the flag or process to fix.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from workers.pool.client_config import PoolClientConfig
from workers.pool.errors import BatchResult, PoolSetupError, PoolTimeoutError
from workers.pool.staging import StagingBuffer, staging_bytes

if TYPE_CHECKING:
    from workers.pool.bounded_call import BoundedCaller

RPC_FAIL = -900
TRANSFER_FAIL = -800
GENERIC_ERROR = -1

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
            "mooncake_master there, or fix --master / PDWORKER_MASTER"
        )
    if speaks_http(host, port):
        raise PoolSetupError(
            f"{master_addr} answers HTTP, so it is not the master's RPC port (the metadata or "
            "admin port?): pass the master's --rpc_port as --master / PDWORKER_MASTER"
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
            "PDWORKER_METADATA"
        )
    if owner_addr is not None:
        host, port = parse_host_port(owner_addr, "--pool-owner")
        reason = probe_tcp(host, port)
        if reason:
            raise PoolSetupError(
                f"cannot reach the pool owner at {owner_addr} ({reason}): start "
                "`pdworker pool`, or fix --pool-owner / PDWORKER_POOL_OWNER (or leave it "
                "unset to use TCP)"
            )


def open_store(c: PoolClientConfig, caller: BoundedCaller) -> tuple[object, StagingBuffer]:
    """Preflight, Mooncake setup (TCP or shared memory), staging buffer allocated and
    registered once; PoolSetupError naming what to fix. The store is closed on any failure."""
    store_cls = import_store()
    preflight(c.master_addr, c.metadata_url, c.owner_addr)
    for name, value in store_env(c.transfer_timeout_s).items():
        os.environ.setdefault(name, value)  # Mooncake reads these only from the environment
    store = store_cls()
    nbytes = staging_bytes(c.num_slots, c.slot_bytes)  # payloads and their headers
    if c.owner_addr is None:
        setup = lambda: store.setup(  # noqa: E731
            c.local_hostname, c.metadata_url, 0, 0, "tcp", "", c.master_addr
        )
    else:
        setup = lambda: store.setup_dummy(nbytes, 0, c.owner_addr)  # noqa: E731
    where = f"master {c.master_addr}, metadata {c.metadata_url}, owner {c.owner_addr or 'tcp'}"
    try:
        rc = caller.call(setup, c.setup_timeout_s, what="Mooncake setup")
    except PoolTimeoutError as exc:
        raise PoolSetupError(f"Mooncake setup did not finish ({where}): {exc}") from exc
    if rc != 0:
        raise PoolSetupError(f"Mooncake setup returned {rc} ({where}); see its log above")
    try:
        if c.owner_addr is None:
            buffer = StagingBuffer(c.num_slots, c.slot_bytes)
        else:
            ptr = store.alloc_from_mem_pool(nbytes)
            if not ptr:
                raise PoolSetupError(f"the owner's shared pool refused {nbytes} bytes")
            buffer = StagingBuffer(c.num_slots, c.slot_bytes, ptr=ptr)
        rc = store.register_buffer(buffer.ptr, buffer.nbytes)
        if rc != 0:
            raise PoolSetupError(f"registering the {nbytes}-byte staging buffer returned {rc}")
    except BaseException:
        store.close()
        raise
    return store, buffer


def explain_failures(result: BatchResult, master_addr: str, owner_addr: str | None) -> BatchResult:
    """Name the real cause where Mooncake's code hides it (a probe or two, only on failure).

    Over TCP (owner_addr None) the client asks the master where a key lives (-900 when the
    master does not answer) and moves the bytes with the owner (-800): the codes are right.
    Over shared memory the client's one peer is the owner, which relays the master's answers,
    so a -900 means "the owner, or the master behind it, did not answer". The master's port
    decides: it refuses -> MASTER_UNREACHABLE; it answers -> the owner failed: TRANSFER_FAILED.
    The owner's own port is no witness: a killed owner's mooncake_client accepts connections
    on it until the last of its threads has exited, which, with its memory to unmap, can come
    after the failure it caused (measured: the failed get, then a probe that connected), so a
    probe of it right after the failure called a dead owner alive in some runs.
    A bare -1 (some calls answer it) becomes -900 when the master's port refuses, and -800 when
    the owner's port refuses while the master's answers.
    """
    if result.ok or (RPC_FAIL not in result.codes and GENERIC_ERROR not in result.codes):
        return result
    master_gone = bool(probe_tcp(*parse_host_port(master_addr, "--master")))
    remap: dict[int, int] = {}
    if master_gone:
        remap[GENERIC_ERROR] = RPC_FAIL
    elif owner_addr is not None:
        remap[RPC_FAIL] = TRANSFER_FAIL
        if GENERIC_ERROR in result.codes and probe_tcp(
            *parse_host_port(owner_addr, "--pool-owner")
        ):
            remap[GENERIC_ERROR] = TRANSFER_FAIL
    return BatchResult.from_codes(result.keys, [remap.get(c, c) for c in result.codes])
