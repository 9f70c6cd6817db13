"""Shards through a real pool: writers of TP size 1, 2 and 4 each write their heads of a
block; readers of every TP size read the shards covering theirs; every pairing byte-exact."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.wait import wait_until
from tests.workers.pool.fixtures import client_config, running_pool  # noqa: F401 (fixture)
from workers.engine.tp.rank_io import read_rank, write_rank
from workers.engine.tp.shards import rank_heads
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.keys import block_keys, shard_key

LAYERS, HEADS, BS, DIM, BLOCKS = 2, 4, 4, 8, 6


def _slots_by() -> float:
    """The staging-slot bound of one call (time.monotonic): 5 s from now."""
    return time.monotonic() + 5.0


def _whole_cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BLOCKS, HEADS, BS, DIM)).astype(np.float32)
            for _ in range(2 * LAYERS)]  # fmt: skip


def _rank_cache(whole: list[np.ndarray], tp: int, rank: int) -> list[np.ndarray]:
    heads = rank_heads(HEADS, tp, rank)
    return [np.ascontiguousarray(t[:, heads.start : heads.end]) for t in whole]


@pytest.fixture(scope="module")
def pool(running_pool) -> Iterator[KVPoolClient]:  # noqa: F811
    slot_bytes = 2 * LAYERS * HEADS * BS * DIM * 4  # a block of every head
    config = PoolClientConfig(**client_config(running_pool, "tcp", num_slots=8,
                                              slot_bytes=slot_bytes))  # fmt: skip
    client = KVPoolClient(config).connect()
    yield client
    client.close()


@pytest.mark.parametrize("writer_tp", [1, 2, 4])
def test_every_reader_tp_gets_its_heads_byte_exact(pool: KVPoolClient, writer_tp: int) -> None:
    whole = _whole_cache(writer_tp)
    keys = block_keys(f"fp{writer_tp}", list(range(BLOCKS * BS)), BS)[:4]
    written = [0, 2, 3, 5]  # the engine's block ids of the four blocks
    for rank in range(writer_tp):
        own = rank_heads(HEADS, writer_tp, rank)
        out = write_rank(
            pool, _rank_cache(whole, writer_tp, rank), own, written, keys, 2, _slots_by()
        )
        assert all(r.ok for r in out.results)
    for reader_tp in (1, 2, 4):
        for rank in range(reader_tp):
            own = rank_heads(HEADS, reader_tp, rank)
            cache = [np.zeros((BLOCKS, own.count, BS, DIM), np.float32) for _ in whole]
            out = read_rank(pool, cache, own, writer_tp, [1, 4, 0, 2], keys, 2, _slots_by())
            assert (out.num_loaded, out.missing_keys) == (4, ())
            for got, want in zip(cache, whole, strict=True):
                np.testing.assert_array_equal(got[[1, 4, 0, 2]], want[written, own.start : own.end])
                assert not got[[3, 5]].any()


def test_a_missing_shard_ends_the_run_for_every_reader(pool: KVPoolClient) -> None:
    whole = _whole_cache(9)
    keys = block_keys("fp-missing", list(range(3 * BS)), BS)
    own = rank_heads(HEADS, 2, 0)  # rank 1 of the writer never writes block 1
    write_rank(pool, _rank_cache(whole, 2, 0), own, [0, 1, 2], keys, 2, _slots_by())
    other = rank_heads(HEADS, 2, 1)
    write_rank(pool, _rank_cache(whole, 2, 1), other, [0, 2], [keys[0], keys[2]], 2, _slots_by())
    cache = [np.zeros((BLOCKS, HEADS, BS, DIM), np.float32) for _ in whole]
    out = read_rank(pool, cache, rank_heads(HEADS, 1, 0), 2, [0, 1, 2], keys, 2, _slots_by())
    assert out.num_loaded == 1
    assert len(out.missing_keys) == 1 and "/h2-4of4/" in out.missing_keys[0]


def test_a_tp1_worker_reads_a_prompt_written_in_two_layouts(pool: KVPoolClient) -> None:
    from workers.engine.tp.sharded_pool import ShardedPool

    whole = _whole_cache(5)
    keys = block_keys("fp-layouts", list(range(BLOCKS * BS)), BS)
    for rank in range(2):  # blocks 0-2 from a P of TP size 2, blocks 3-5 from one of size 1
        own = rank_heads(HEADS, 2, rank)
        write_rank(pool, _rank_cache(whole, 2, rank), own, [0, 1, 2], keys[:3], 2, _slots_by())
    write_rank(pool, whole, rank_heads(HEADS, 1, 0), [3, 4, 5], keys[3:], 2, _slots_by())
    sharded = ShardedPool(pool, tp_size=1, num_kv_heads=HEADS, peers=None)
    assert sharded.exists(keys) == [True] * BLOCKS
    cache = [np.zeros_like(t) for t in whole]
    out = sharded.get_sharded(cache, [5, 4, 3, 2, 1, 0], keys, 2, True, None, _slots_by())
    assert (out.num_loaded, out.missing_keys) == (BLOCKS, ())
    for got, want in zip(cache, whole, strict=True):
        np.testing.assert_array_equal(got[::-1], want)
    # One shard of block 1 gone: the block is absent in every layout, and reading stops there.
    shard = shard_key(keys[1], 2, 4, 4)
    wait_until(lambda: pool.remove([shard]).ok, 15, "the read lease to expire", interval_s=0.1)
    assert sharded.exists(keys) == [True, False] + [True] * 4
    out = sharded.get_sharded(cache, [0, 1, 2, 3, 4, 5], keys, 2, True, None, _slots_by())
    assert out.num_loaded == 1 and out.missing_keys[0] == keys[1]


class _ExistsFails:
    """The real client whose exists() fails (a master that stopped answering)."""

    def __init__(self, inner: KVPoolClient) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def exists(self, keys: object) -> list[bool]:
        from workers.pool.errors import PoolError

        raise PoolError("exists failed")


def test_a_pool_that_cannot_say_which_layout_reads_the_own_one(pool: KVPoolClient) -> None:
    from workers.engine.tp.sharded_pool import ShardedPool

    whole = _whole_cache(6)
    keys = block_keys("fp-sick", list(range(2 * BS)), BS)
    write_rank(pool, whole, rank_heads(HEADS, 1, 0), [0, 1], keys, 2, _slots_by())
    sharded = ShardedPool(_ExistsFails(pool), tp_size=1, num_kv_heads=HEADS, peers=None)
    cache = [np.zeros_like(t) for t in whole]
    out = sharded.get_sharded(
        cache, [0, 1], keys, 2, True, None, _slots_by()
    )  # no exception: read as before
    assert out.num_loaded == 2
    np.testing.assert_array_equal(cache[0][:2], whole[0][:2])


class _CountingExists:
    """The real client; records how many keys each exists() call asked."""

    def __init__(self, inner: KVPoolClient) -> None:
        self.inner, self.asked = inner, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def exists(self, keys: list[str]) -> list[bool]:
        self.asked.append(len(keys))
        return self.inner.exists(keys)


def _write_8_heads(pool: KVPoolClient, keys: list[str], writer_tp: int) -> None:
    """A writer of TP size writer_tp puts its shards of 8 heads (head dim 4: one slot)."""
    whole = [np.ones((len(keys), 8, BS, 4), np.float32) for _ in range(2 * LAYERS)]
    for rank in range(writer_tp):
        own = rank_heads(8, writer_tp, rank)
        part = [np.ascontiguousarray(t[:, own.start : own.end]) for t in whole]
        out = write_rank(pool, part, own, list(range(len(keys))), keys, 4, _slots_by())
        assert all(r.ok for r in out.results)


def test_a_miss_asks_other_layouts_for_its_first_block_only(pool: KVPoolClient) -> None:
    from workers.engine.tp.sharded_pool import ShardedPool

    counting = _CountingExists(pool)
    sharded = ShardedPool(counting, tp_size=1, num_kv_heads=8, peers=None)
    absent = block_keys("fp-probe-absent", list(range(5 * BS)), BS)
    # Nothing anywhere: 5 own keys, then sizes 2, 4 and 8 for the first block only (2+4+8),
    # where asking every size for every block was 5 + 14 * 5.
    assert sharded.exists(absent) == [False] * 5
    assert counting.asked == [5, 14]
    by_tp2 = block_keys("fp-probe-tp2", list(range(4 * BS)), BS)
    _write_8_heads(pool, by_tp2, 2)
    counting.asked.clear()
    # Found in size 2 through the first block, then its 3 other blocks asked of size 2 only.
    assert sharded.exists(by_tp2) == [True] * 4
    assert counting.asked == [4, 14, 3 * 2]
    counting.asked.clear()
    # Size 2 is known now: every lacking block in it (4 * 2), sizes 4 and 8 the first (4 + 8).
    assert sharded.exists(by_tp2) == [True] * 4
    assert sharded.exists(absent) == [False] * 5
    assert counting.asked == [4, 8 + 12, 5, 10 + 12]
    # A worker of a new size (4) joins: found on its first block, then asked in full.
    by_tp4 = block_keys("fp-probe-tp4", list(range(3 * BS)), BS)
    _write_8_heads(pool, by_tp4, 4)
    counting.asked.clear()
    assert sharded.exists(by_tp4) == [True] * 3
    assert counting.asked == [3, 3 * 2 + 12, 2 * 4]
    counting.asked.clear()
    assert sharded.exists(by_tp4) == [True] * 3
    assert counting.asked == [3, 3 * 2 + 3 * 4 + 8]
