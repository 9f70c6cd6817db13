"""Mooncake's process-wide table of shared memory, and when it is safe to add to it.

Every shared-memory staging of a process (`alloc_from_mem_pool`, one per Link: pool_link.py)
is an entry of one table (Mooncake 0.3.13's ShmHelper, a singleton; no call frees an entry).
A client whose ping to the owner fails enters Mooncake's own reconnection loop: every 2 s it
walks that table, registering each entry with the owner again over a local socket, without
the table's lock. An entry added meanwhile (a new link's staging) can move the table under
the walk: past its first entry, the walk reads freed memory, and the process dies of SIGSEGV.
A P worker did once in a full test run, its pool client reconnecting after a master restart
(every client of the process is in that loop then, and the owner maps again as it recovers).

So an addition waits, under one lock per process, until no client walks the table: every
client's health_check() is 0 (its ping thread is in its plain state, which never touches the
table), or the client's owner refuses connections (then the walk ends at its first entry,
whose registration fails at once). If that does not come within the bound: ShmTableBusy, and
the reconnect waits for a later probe (pool_health.py), which says why meanwhile. A ping can
still fail right after the check (the owner falls ill that instant): that window is Mooncake's
and is not closed here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from workers.pool.connect import parse_host_port, probe_tcp
from workers.pool.errors import PoolError

HEALTHY = 0  # Mooncake's HC_HEALTHY
POLL_S = 0.05


class ShmTableBusy(PoolError):
    """A client of this process is in Mooncake's reconnection loop: the table stays as it is."""


@dataclass(frozen=True)
class _Client:
    store: object
    owner_addr: str


class ShmTable:
    """The shared-memory clients of this process, and the lock every addition takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one addition at a time
        self._members = threading.Lock()  # _clients (held only to read or replace it)
        self._clients: tuple[_Client, ...] = ()

    def walking(self) -> list[str]:
        """The owners of the clients now in Mooncake's reconnection loop with a live owner."""
        with self._members:
            clients = self._clients
        return [c.owner_addr for c in clients if _walks(c)]

    @contextmanager
    def change(self, timeout_s: float) -> Iterator[None]:
        """Hold the table for one addition, once no client walks it (ShmTableBusy at timeout)."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise ShmTableBusy(f"another change of the shared-memory table took {timeout_s:g} s")
        try:
            while owners := self.walking():
                if time.monotonic() >= deadline:
                    raise ShmTableBusy(
                        "Mooncake's own reconnection is running in this process (clients of "
                        f"{', '.join(sorted(set(owners)))}); its shared-memory table is left "
                        f"as it is (waited {timeout_s:g} s)"
                    )
                time.sleep(POLL_S)
            yield
        finally:
            self._lock.release()

    def add(self, store: object, owner_addr: str) -> None:
        """A client set up under change(): its loop is waited for from now on."""
        with self._members:
            self._clients += (_Client(store, owner_addr),)

    def remove(self, store: object) -> None:
        """A client about to be closed: no longer asked (a closed one answers not-initialized)."""
        with self._members:
            self._clients = tuple(c for c in self._clients if c.store is not store)


def _walks(client: _Client) -> bool:
    if client.store.health_check() == HEALTHY:  # type: ignore[attr-defined]
        return False
    return probe_tcp(*parse_host_port(client.owner_addr, "--owner")) is None


SHM_TABLE = ShmTable()
