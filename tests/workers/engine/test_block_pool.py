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
