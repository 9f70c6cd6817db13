"""The pool owner draws the ports it was not given (its mooncake_client's, and --owner-port
when 0), never one it was given and binds later: its --port is bound only once the pool is up."""

from __future__ import annotations

import pytest

from pdrouter.common import proc
from pdrouter.common.proc import PORT_RANGE_ENV, find_free_port, port_range
from workers.pool.owner_process import OwnerConfig, OwnerProcess

MiB = 1 << 20


def _config(**ports: int) -> OwnerConfig:
    return OwnerConfig(size_bytes=64 * MiB, master_addr="127.0.0.1:1",
                       metadata_url="http://127.0.0.1:1/metadata", **ports)  # fmt: skip


def _below_top(n: int) -> tuple[int, int]:
    """This test worker's range less its last n - 1 ports: n ports from any draw stay in it."""
    low, high = port_range(20000, 32000)
    return low, high - (n - 1)


@pytest.fixture
def four_ports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A range of four ports (two draws before the handed-out set starts again), free now."""
    low = find_free_port(*_below_top(4))
    monkeypatch.setenv(PORT_RANGE_ENV, f"{low}-{low + 4}")
    return [low, low + 1, low + 2, low + 3]


def test_the_mooncake_clients_port_is_none_of_the_given_ones(
    monkeypatch: pytest.MonkeyPatch, four_ports: list[int]
) -> None:
    http, owner, *free = four_ports
    for _ in range(20):
        monkeypatch.setattr(proc, "_HANDED_OUT", set())
        drawn = OwnerProcess(_config(http_port=http, owner_port=owner))
        assert drawn.owner_port == owner and drawn.child_http_port in free


def test_a_drawn_owner_port_is_not_the_given_http_port(
    monkeypatch: pytest.MonkeyPatch, four_ports: list[int]
) -> None:
    http, *free = four_ports
    for _ in range(20):
        monkeypatch.setattr(proc, "_HANDED_OUT", set())
        drawn = OwnerProcess(_config(http_port=http))
        assert drawn.owner_port in free and drawn.child_http_port in free
        assert drawn.owner_port != drawn.child_http_port
