"""ShmTable: a change of Mooncake's process-wide shared-memory table waits until no client of
the process is in Mooncake's reconnection loop with a live owner (workers/pool/shm_table.py).
Stores here are stand-ins with a settable health_check(); owners are real loopback sockets."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from pdrouter.common.proc import find_free_port
from tests.wait import wait_until
from workers.pool.shm_table import HEALTHY, ShmTable, ShmTableBusy

IN_LOOP = 2  # Mooncake's HC_MASTER_UNREACHABLE: the client's ping failed, its loop runs


class _Store:
    def __init__(self, health: int) -> None:
        self.health = health
        self.checks = 0

    def health_check(self) -> int:
        self.checks += 1
        return self.health


@pytest.fixture
def live_owner() -> Iterator[str]:
    """An address that accepts connections, as a running owner's does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_a_change_waits_until_the_walking_client_is_healthy(live_owner: str) -> None:
    table, store = ShmTable(), _Store(IN_LOOP)
    table.add(store, live_owner)
    changed = threading.Event()

    def change() -> None:
        with table.change(timeout_s=30.0):
            changed.set()

    thread = threading.Thread(target=change)
    thread.start()
    try:
        wait_until(lambda: store.checks, 10.0, "the change to ask twice", done=lambda n: n >= 2)
        assert not changed.is_set()  # it waited: the client was walking the table
        store.health = HEALTHY
        assert changed.wait(10.0)
    finally:
        store.health = HEALTHY
        thread.join(10.0)


def test_a_change_past_its_bound_is_refused_naming_the_owner(live_owner: str) -> None:
    table, store = ShmTable(), _Store(IN_LOOP)
    table.add(store, live_owner)
    entered = False
    with pytest.raises(ShmTableBusy, match=f"clients of {live_owner}\\)"), table.change(0.2):
        entered = True
    assert not entered
    assert store.checks >= 2
    assert table.walking() == [live_owner]


def test_a_client_whose_owner_is_gone_is_not_waited_for() -> None:
    table, store = ShmTable(), _Store(IN_LOOP)
    table.add(store, f"127.0.0.1:{find_free_port()}")  # nothing listens there
    assert table.walking() == []
    with table.change(timeout_s=0.0):
        pass


def test_a_removed_client_is_no_longer_asked(live_owner: str) -> None:
    table, kept, removed = ShmTable(), _Store(HEALTHY), _Store(IN_LOOP)
    table.add(kept, live_owner)
    table.add(removed, live_owner)
    assert table.walking() == [live_owner]
    table.remove(removed)
    removed.checks = 0
    with table.change(timeout_s=0.0):
        pass
    assert (removed.checks, kept.checks > 0) == (0, True)


def test_one_change_at_a_time() -> None:
    table = ShmTable()
    busy = pytest.raises(ShmTableBusy, match="another change")
    with table.change(timeout_s=1.0), busy, table.change(timeout_s=0.1):
        pass
    with table.change(timeout_s=0.0):  # released after the first
        pass
