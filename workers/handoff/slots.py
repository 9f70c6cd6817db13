"""The staging-slot wait every handoff copy starts with, and the part of the pool client the
handoff uses (KVPoolClient satisfies it; tests pass the fault pool)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from pdrouter.wire.errors import unavailable
from workers.pool.errors import BatchResult

if TYPE_CHECKING:  # pipeline.py imports this module
    from workers.handoff.outcomes import GetOutcome, PutOutcome
    from workers.pool.header_calls import LateHeaders


class Slots(Protocol):
    def allocate(self, num_slots: int) -> list[int] | None: ...

    def free(self, slots: Sequence[int]) -> None: ...


class _PoolConfig(Protocol):
    @property
    def slot_bytes(self) -> int: ...


class ShardedBlocks(Protocol):
    """A pool that moves a request's blocks itself, each rank its heads
    (workers/engine/tp/sharded_pool.py ShardedPool): put_blocks / get_blocks hand it the call
    with every bound the caller gave."""

    def put_sharded(
        self,
        tensors: Sequence[object],
        block_ids: Sequence[int],
        keys: Sequence[str],
        group: int,
        overlap: bool,
        slots_by_s: float,
    ) -> PutOutcome: ...

    def get_sharded(
        self,
        tensors: Sequence[object],
        block_ids: Sequence[int],
        keys: Sequence[str],
        group: int,
        overlap: bool,
        stop_at_s: float | None,
        slots_by_s: float,
    ) -> GetOutcome: ...


class HandoffPool(Protocol):
    """What the handoff calls on every layer of a worker's pool: KVPoolClient (host staging),
    DevicePool (device staging), CheckedPool, ShardedPool and a rank's HeadsView. The two
    optional capabilities are declared by every layer, None where it lacks them, so the
    pipeline reads them off the type and never asks the object what it can do."""

    # Blocks with checked headers (CheckedPool): header puts run behind the next group.
    headers_later: Callable[[], AbstractContextManager[LateHeaders]] | None
    # Blocks spread over the TP ranks (ShardedPool): the pool moves them itself.
    sharded: ShardedBlocks | None

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
