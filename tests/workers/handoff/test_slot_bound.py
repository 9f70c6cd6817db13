"""A caller's staging-slot bound reaches the wait through every layer of a worker's pool.

The store under the layers has every staging slot taken (another request's copies hold them),
so a handoff call can only wait for slots until its bound, then answer 503 staging_full. Each
test puts one more real layer between the caller and that store: the bare fault pool, the
ShardedPool (its HeadsView per rank), and the production stack CheckedPool(DevicePool) under
it. A layer that substituted its own bound (--pool-wait-s, 30 s in production) for the
caller's would hold the call past BOUND_S; none may.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from pdrouter.wire.errors import APIError
from tests.workers.handoff.fake_pool import FakePool, kv_views
from tests.workers.pool.device_double import HostBackedStaging, ScriptedClient
from workers.engine.tp.rank_io import read_rank, write_rank
from workers.engine.tp.sharded_pool import ShardedPool
from workers.engine.tp.shards import rank_heads
from workers.handoff.reader import load_blocks
from workers.handoff.writer import write_blocks
from workers.pool.checked_pool import CheckedPool
from workers.pool.device_pool import DevicePool
from workers.pool.keys import block_keys

BLOCK_SIZE, NUM_BLOCKS, SLOTS = 4, 8, 4
BOUND_S = 0.3  # the caller's bound
LAYER_WAIT_S = 30.0  # what a layer's own bound would be (the --pool-wait-s default)
WELL_UNDER_S = 1.5  # a call that honoured BOUND_S ends long before this
KEYS = block_keys("fp-slot-bound", list(range(3 * BLOCK_SIZE)), BLOCK_SIZE)


def _caches() -> list[np.ndarray]:
    return kv_views(np.zeros((NUM_BLOCKS, BLOCK_SIZE), np.int64))


def _bare() -> tuple[Any, Any]:
    pool = FakePool(BLOCK_SIZE, num_slots=SLOTS)
    return pool, pool.slots


def _sharded() -> tuple[Any, Any]:
    pool = FakePool(BLOCK_SIZE, num_slots=SLOTS)
    return ShardedPool(pool, tp_size=1, num_kv_heads=1, peers=None), pool.slots


def _production() -> tuple[Any, Any]:
    """ShardedPool over CheckedPool over DevicePool over the client (pd_worker's order)."""
    slot_bytes = 2 * BLOCK_SIZE * 8
    client = ScriptedClient(slot_bytes, SLOTS)
    staging = HostBackedStaging(SLOTS, slot_bytes)
    checked = CheckedPool(DevicePool(client, staging), BLOCK_SIZE)
    return ShardedPool(checked, tp_size=1, num_kv_heads=1, peers=None), staging.slots


STACKS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "fake pool": _bare,
    "sharded": _sharded,
    "production": _production,
}


@pytest.fixture(params=list(STACKS))
def full_stack(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The stack with every staging slot of its innermost store taken."""
    pool, slots = STACKS[request.param]()
    held = slots.allocate(SLOTS)
    assert held is not None
    yield pool
    slots.free(held)
    slots.check_integrity()


def _gives_up_by_the_bound(call: Callable[[], object]) -> None:
    t0 = time.monotonic()
    with pytest.raises(APIError) as caught:
        call()
    took_s = time.monotonic() - t0
    assert (caught.value.status, caught.value.code) == (503, "staging_full")
    assert BOUND_S - 0.05 <= took_s < WELL_UNDER_S, f"gave up after {took_s:.2f} s"


def test_a_load_gives_up_at_the_callers_deadline(full_stack: Any) -> None:
    """The prefix load's bound (reader.load_blocks deadline_s) under a longer wait_s."""
    _gives_up_by_the_bound(
        lambda: load_blocks(
            full_stack,
            _caches(),
            KEYS,
            [0, 1, 2],
            group_blocks=2,
            wait_s=LAYER_WAIT_S,
            deadline_s=time.monotonic() + BOUND_S,
        )
    )


def test_a_write_gives_up_at_the_callers_wait(full_stack: Any) -> None:
    _gives_up_by_the_bound(
        lambda: write_blocks(full_stack, _caches(), KEYS, [0, 1, 2], group_blocks=2, wait_s=BOUND_S)
    )


@pytest.mark.parametrize("side", ["write", "read"])
def test_one_rank_waits_until_the_callers_instant(side: str) -> None:
    """write_rank / read_rank (a HeadsView of the pool): the bound every rank is handed."""
    pool = FakePool(BLOCK_SIZE, num_slots=SLOTS)
    held = pool.slots.allocate(SLOTS)
    own = rank_heads(1, 1, 0)

    def call() -> object:
        by_s = time.monotonic() + BOUND_S
        if side == "write":
            return write_rank(pool, _caches(), own, [0, 1], KEYS[:2], 2, by_s)
        return read_rank(pool, _caches(), own, 1, [0, 1], KEYS[:2], 2, by_s)

    _gives_up_by_the_bound(call)
    pool.slots.free(held or [])
    pool.slots.check_integrity()
