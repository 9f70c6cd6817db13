"""BlockPool: exact block ids, ref counts and free order (no Paddle)."""

from __future__ import annotations

import pytest

from workers.engine.block_pool import BlockPool


def test_allocates_from_the_front_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 1
    assert pool.num_used == 5
    assert [pool.ref_count(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    pool.check_integrity()


def test_allocate_zero_returns_empty_list() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_no_room_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.free_ids() == [3]
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_in_the_order_given() -> None:
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    assert pool.free_ids() == [4, 5, 2, 0]
    assert pool.allocate(3) == [4, 5, 2]
    pool.free([3, 1])
    assert pool.free_ids() == [0, 3, 1]
    pool.check_integrity()


def test_shared_block_is_freed_only_at_zero() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.incref([1])
    assert pool.ref_count(1) == 2
    pool.free([0, 1])
    assert pool.ref_count(0) == 0
    assert pool.ref_count(1) == 1
    assert pool.free_ids() == [2, 0]
    pool.free([1])
    assert pool.free_ids() == [2, 0, 1]
    assert pool.num_used == 0
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    with pytest.raises(ValueError, match="block 1: 2 release"):
        pool.free([0, 1, 1])
    assert pool.ref_count(0) == 1
    assert pool.ref_count(1) == 1
    assert pool.free_ids() == [2]
    pool.free([0])
    with pytest.raises(ValueError, match=r"block 0: 1 release.*ref count is 0"):
        pool.free([0])
    pool.check_integrity()


def test_misuse_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside"):
        pool.free([2])
    with pytest.raises(ValueError, match="outside"):
        pool.ref_count(-1)
    with pytest.raises(ValueError, match="which is free"):
        pool.incref([0])
    with pytest.raises(ValueError, match="num_blocks >= 0"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[1] = 1  # referenced yet still on the free list
    with pytest.raises(AssertionError, match="block 1: ref count 1 but in the free list"):
        pool.check_integrity()


# ---- with prefix caching on --------------------------------------------------------------


def cached_pool(num_blocks: int, cached: dict[int, str]) -> BlockPool:
    """A caching pool where each block of `cached` was allocated, registered and released
    (in the dict's order); the rest are free."""
    pool = BlockPool(num_blocks, enable_caching=True)
    block_ids = pool.allocate(num_blocks)
    for block_id, block_hash in cached.items():
        assert pool.cache_block(block_id, block_hash)
    pool.free([b for b in block_ids if b not in cached])
    pool.free(list(cached))
    return pool


def test_a_released_cached_block_stays_cached_and_is_allocated_after_free_ones() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.cache_block(0, "h0") and pool.cache_block(1, "h1")
    pool.free([2, 1, 0])
    # 2 was never cached: the free list; 1 then 0 are evictable, least recently released first.
    assert pool.free_ids() == [3, 4, 2, 1, 0]
    assert pool.cached_blocks() == {"h0": 0, "h1": 1}
    assert (pool.num_free, pool.num_used, pool.num_cached) == (5, 0, 2)
    assert pool.allocate(3) == [3, 4, 2]  # never-cached blocks first: nothing evicted
    assert pool.cached_blocks() == {"h0": 0, "h1": 1}
    assert pool.allocate(1) == [1]  # then the least recently released cached block
    assert pool.cached_blocks() == {"h0": 0}
    assert (pool.block_hash(1), pool.lookup("h1"), pool.lookup("h0")) == (None, None, 0)
    pool.free([1])  # evicted: it comes back uncached, to the free list
    assert pool.free_ids() == [1, 0]
    pool.check_integrity()


def test_touch_takes_a_cached_block_back_with_a_reference() -> None:
    pool = cached_pool(4, {1: "h1", 2: "h2"})
    assert pool.free_ids() == [0, 3, 1, 2]
    pool.touch([2])  # evictable -> referenced, off the lists
    assert (pool.ref_count(2), pool.free_ids(), pool.num_used) == (1, [0, 3, 1], 1)
    pool.touch([2])  # already referenced: shared
    assert pool.ref_count(2) == 2
    assert pool.allocate(3) == [0, 3, 1]  # 2 is not evictable while referenced
    assert pool.allocate(1) is None
    assert pool.cached_blocks() == {"h2": 2}
    pool.free([2, 2])
    assert pool.free_ids() == [2]
    pool.check_integrity()


def test_lru_order_is_release_order_and_a_hit_renews_it() -> None:
    pool = cached_pool(4, {0: "a", 1: "b", 2: "c", 3: "d"})
    assert pool.free_ids() == [0, 1, 2, 3]
    pool.touch([0])
    pool.free([0])  # released again: most recently used now
    assert pool.free_ids() == [1, 2, 3, 0]
    assert pool.allocate(2) == [1, 2]
    assert pool.cached_blocks() == {"a": 0, "d": 3}
    pool.check_integrity()


def test_first_registration_of_a_hash_wins() -> None:
    pool = BlockPool(3, enable_caching=True)
    assert pool.allocate(2) == [0, 1]
    assert pool.cache_block(0, "h") is True
    assert pool.cache_block(1, "h") is False  # same content computed twice: 1 stays uncached
    assert pool.cache_block(0, "h") is True  # registering again is a no-op
    assert pool.cached_blocks() == {"h": 0}
    assert pool.block_hash(1) is None
    pool.free([0, 1])
    assert pool.free_ids() == [2, 1, 0]
    pool.check_integrity()


def test_cache_misuse_raises() -> None:
    pool = BlockPool(3, enable_caching=True)
    assert pool.allocate(2) == [0, 1]
    assert pool.cache_block(0, "h0")
    with pytest.raises(ValueError, match="block 0 under h1: it is cached under h0"):
        pool.cache_block(0, "h1")
    with pytest.raises(ValueError, match="cache_block\\(\\) of block 2, which is free"):
        pool.cache_block(2, "h2")
    with pytest.raises(ValueError, match="touch\\(\\) of block 1, which is not cached"):
        pool.touch([0, 1])
    assert pool.ref_count(0) == 1  # the failed touch took nothing
    with pytest.raises(ValueError, match="caching off"):
        BlockPool(2).cache_block(0, "h")
    pool.check_integrity()


def test_check_integrity_catches_hash_map_corruption() -> None:
    pool = cached_pool(3, {0: "h0"})
    pool._block_to_hash[1] = "h1"  # a hash on a block of the free list, not in the map
    with pytest.raises(AssertionError, match="1 hashes map to blocks but 2 blocks carry"):
        pool.check_integrity()
    pool._hash_to_block["h1"] = 1
    with pytest.raises(AssertionError, match="block 1 is on the free list but cached"):
        pool.check_integrity()
    pool = cached_pool(3, {0: "h0"})
    pool._hash_to_block["h0"] = 2  # the map points at another block
    with pytest.raises(AssertionError, match="hash h0 maps to block 2, which carries None"):
        pool.check_integrity()
    pool = cached_pool(3, {0: "h0"})
    del pool._hash_to_block["h0"], pool._block_to_hash[0]  # evictable without a hash
    with pytest.raises(AssertionError, match="block 0 is evictable but carries no hash"):
        pool.check_integrity()
    pool = cached_pool(3, {0: "h0"})
    pool._free_ids.append(0)  # listed twice: free and evictable
    with pytest.raises(AssertionError, match=r"blocks \[0\] are both free and evictable"):
        pool.check_integrity()
