"""P's write_blocks against the fault pool: what it puts, skips and leaves alone."""

from __future__ import annotations

import numpy as np

from tests.workers.handoff.fake_pool import FakePool, block_value, kv_views
from workers.handoff.writer import write_blocks

BLOCK_SIZE = 4


def _cache() -> np.ndarray:
    """Three blocks whose token ids are 0..11 (the NumpyRunner KV of a position)."""
    return np.arange(3 * BLOCK_SIZE, dtype=np.int64).reshape(3, BLOCK_SIZE)


def test_writes_what_the_pool_lacks_and_skips_the_rest() -> None:
    pool = FakePool(BLOCK_SIZE)
    pool.store["k0"] = block_value(range(0, 4))
    out = write_blocks(pool, kv_views(_cache()), ["k0", "k1", "k2"], [0, 1, 2],
                       group_blocks=2, wait_s=1.0)  # fmt: skip
    assert (out.num_written, out.num_skipped) == (2, 1)
    assert pool.store["k2"] == block_value(range(8, 12))
    assert pool.slots.num_free == 16


def test_a_degraded_pool_gets_no_copy_and_no_put() -> None:
    # While the client reconnects, every put would fail fast: P copies nothing out of its
    # cache for it, takes no staging slot and logs nothing per request (D recomputes).
    pool = FakePool(BLOCK_SIZE)
    pool.degraded = True
    out = write_blocks(pool, kv_views(_cache()), ["k0", "k1", "k2"], [0, 1, 2],
                       group_blocks=2, wait_s=1.0)  # fmt: skip
    assert (out.num_written, out.num_skipped, out.num_bytes) == (0, 0, 0)
    assert pool.calls == [("exists", 3)]
    assert pool.store == {}
    assert pool.slots.num_free == 16
