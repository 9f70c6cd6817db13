"""The launcher's start-up warning names every Mooncake socket that listens on every interface
(the list itself is asserted against a real cluster by tests/e2e/security)."""

from __future__ import annotations

from pdrouter.launch.exposure import EXPOSURES, POOL_TCP_EXPOSURES, launch_warnings


def test_warning_lists_every_socket_beyond_the_host() -> None:
    lines = launch_warnings("127.0.0.1")
    assert lines == [
        "security: 7 Mooncake sockets have no authentication; 3 of them listen on every "
        "interface whatever the host:",
        "  mooncake_client on 0.0.0.0: transfer-engine handshake daemon",
        "  mooncake_client on ::: transfer-engine TCP data port (dual stack)",
        "  mooncake_client on 0.0.0.0: embedded HTTP /health, /metrics",
        "  firewall them from other hosts: see docs/security.md",
    ]
    assert len(EXPOSURES) == 7


def test_pool_tcp_and_a_network_host_add_their_lines() -> None:
    lines = launch_warnings("10.0.0.5", pool_tcp=True)
    assert lines[4:] == [
        "  --pool-tcp: every prefill and decode worker adds two more, as well:",
        *(f"  worker on {e.bind}: {e.what}" for e in POOL_TCP_EXPOSURES),
        "  host 10.0.0.5 is not loopback: the master, metadata and owner ports on it are open "
        "to that network too",
        "  firewall them from other hosts: see docs/security.md",
    ]
