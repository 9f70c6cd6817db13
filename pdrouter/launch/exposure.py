"""What a launched cluster exposes that no key protects: Mooncake's sockets.

Everything pdrouter and pdworker serve themselves binds the launcher's host and answers 401
without a key (pdrouter.common.doors). Mooncake 0.3.13's sockets cannot all be made to: this
is the list, measured on a default `pdrouter launch` (ports from /proc/<pid>/net/tcp*, mapped
through /proc/<pid>/fd), and asserted exactly by tests/e2e/security/test_cluster_audit.py, so
a new socket fails that test until it is listed here and in docs/security.md.

bind "host" is the launcher's --host; "0.0.0.0" and "::" are every IPv4 / every IPv4 and
IPv6 address (a dual-stack socket), whatever --host says. Tried and not enough:
mooncake_client's --host (names the address it advertises, not where it listens),
MC_TCP_BIND_ADDRESS (no effect on these listeners), MC_LEGACY_RPC_PORT_BINDING=1 (the
client fails to start). The master's embedded metadata server ignores
--http_metadata_server_host, so the launcher runs `pdworker metadata` on the host instead.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Exposure:
    process: (
        str  # "mooncake_master", "mooncake_client" (the pool owner's child), "pdworker metadata"
    )
    bind: str  # "host", "0.0.0.0" or "::"
    what: str
    risk: str  # what someone who reaches it can do


EXPOSURES: tuple[Exposure, ...] = (
    Exposure(
        "mooncake_master",
        "host",
        "master RPC (workers' --master)",
        "allocate, look up and remove any pool object",
    ),
    Exposure(
        "mooncake_master",
        "host",
        "admin HTTP: /metrics, /health, /get_all_keys, /query_key",
        "list every key (prompt block hashes) and read pool statistics",
    ),
    Exposure(
        "pdworker metadata",
        "host",
        "transfer metadata store (workers' --metadata)",
        "rewrite or delete segment descriptors, redirecting KV transfers",
    ),
    Exposure(
        "mooncake_client",
        "host",
        "pool owner RPC (workers' --pool-owner)",
        "read and write pool memory through the owner",
    ),
    Exposure(
        "mooncake_client",
        "0.0.0.0",
        "transfer-engine handshake daemon",
        "open transfer sessions with the owner's segment",
    ),
    Exposure(
        "mooncake_client",
        "::",
        "transfer-engine TCP data port (dual stack)",
        "read and write the pool memory the owner mounts",
    ),
    Exposure(
        "mooncake_client", "0.0.0.0", "embedded HTTP /health, /metrics", "read transfer statistics"
    ),
)

# With --pool-tcp, each prefill and decode worker runs a transfer engine of its own (measured
# the same way): these two sockets per worker, on top of EXPOSURES.
POOL_TCP_EXPOSURES: tuple[Exposure, ...] = (
    Exposure(
        "worker",
        "0.0.0.0",
        "transfer-engine handshake daemon",
        "open transfer sessions with the worker's staging buffer",
    ),
    Exposure(
        "worker",
        "::",
        "transfer-engine TCP data port (dual stack)",
        "read and write the worker's registered staging buffer",
    ),
)


def launch_warnings(host: str, pool_tcp: bool = False) -> list[str]:
    """What `pdrouter launch` prints at start: the unauthenticated Mooncake sockets."""
    everywhere = [e for e in EXPOSURES if e.bind != "host"]
    lines = [
        f"security: {len(EXPOSURES)} Mooncake sockets have no authentication; "
        f"{len(everywhere)} of them listen on every interface whatever the host:",
    ]
    lines += [f"  {e.process} on {e.bind}: {e.what}" for e in everywhere]
    if pool_tcp:
        lines.append("  --pool-tcp: every prefill and decode worker adds two more, as well:")
        lines += [f"  {e.process} on {e.bind}: {e.what}" for e in POOL_TCP_EXPOSURES]
    if host not in LOOPBACK:
        lines.append(
            f"  host {host} is not loopback: the master, metadata and owner ports on it are "
            "open to that network too"
        )
    lines.append("  firewall them from other hosts: see docs/security.md")
    return lines
