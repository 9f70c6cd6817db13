"""The staging-slot wait every handoff copy starts with, and the part of the pool client the
handoff uses (KVPoolClient satisfies it; tests pass the fault pool)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from pdrouter.wire.errors import unavailable
from workers.pool.errors import BatchResult


class Slots(Protocol):
    def allocate(self, num_slots: int) -> list[int] | None: ...

    def free(self, slots: Sequence[int]) -> None: ...


class _PoolConfig(Protocol):
    @property
    def slot_bytes(self) -> int: ...


class HandoffPool(Protocol):
    """What the handoff calls on workers.pool.client.KVPoolClient (host staging) and on
    workers.pool.device_pool.DevicePool (device staging)."""

    @property
    def is_open(self) -> bool: ...

    @property
    def config(self) -> _PoolConfig: ...

    @property
    def slots(self) -> Slots: ...

    @property
    def buffer(self) -> object: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get_into(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult: ...

    def put_from(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult: ...


def wait_for_slots(pool: HandoffPool, num_slots: int, deadline_s: float) -> list[int]:
    """num_slots staging slots by deadline_s (time.monotonic), else 503 staging_full, which
    the router answers by trying another worker. A thread helper: it blocks until slots are
    freed (SlotAllocator.allocate_within)."""
    slots = pool.slots.allocate_within(num_slots, deadline_s - time.monotonic())
    if slots is None:
        raise unavailable(f"no {num_slots} free staging slots in time", "staging_full")
    return slots
