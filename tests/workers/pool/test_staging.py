"""StagingBuffer layout and SlotAllocator state, exactly."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from tests.wait import wait_until
from workers.pool.staging import SlotAllocator, StagingBuffer


def test_buffer_slots_are_contiguous_views_of_one_region():
    buf = StagingBuffer(num_slots=4, slot_bytes=4096)
    # The slots, then one 64-byte object header per slot (workers/pool/object_header.py).
    assert buf.nbytes == 16384 + 4 * 64 and buf.view.shape == (4, 4096)
    assert buf.headers.shape == (4, 64)
    assert buf.ptr % 4096 == 0  # page aligned: a device can register it
    assert [buf.slot_ptr(s) - buf.ptr for s in range(4)] == [0, 4096, 8192, 12288]
    assert [p - buf.ptr for p in buf.header_ptrs] == [16384, 16448, 16512, 16576]
    assert buf.slot_ptrs == [buf.slot_ptr(s) for s in range(4)]
    buf.write_headers([3, 1], np.array([[3] * 64, [1] * 64], np.uint8))
    assert buf.read_headers([1, 3]).tolist() == [[1] * 64, [3] * 64]
    assert not buf.view.any() and not buf.headers[[0, 2]].any()
    buf.headers[:] = 0
    assert not buf.view.any()
    buf.slot(2)[:] = 7
    raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr)
    assert bytes(raw[8192:8196]) == b"\x07\x07\x07\x07"
    assert raw[8191] == 0 and raw[12288] == 0
    with pytest.raises(IndexError, match="slot 4 out of range"):
        buf.slot_ptr(4)


def test_buffer_can_wrap_foreign_memory():
    backing = np.zeros(3 * (100 + 64), np.uint8)  # slots and their headers
    buf = StagingBuffer(3, 100, ptr=backing.ctypes.data)
    buf.slot(1)[:] = 9
    assert backing[100:200].tolist() == [9] * 100 and backing[:100].sum() == 0
    with pytest.raises(ValueError, match="num_slots >= 1"):
        StagingBuffer(0, 100)


def test_allocate_lowest_first_and_none_when_short():
    alloc = SlotAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(3) is None  # all or nothing
    assert alloc.num_free == 2
    assert alloc.allocate(2) == [2, 3]
    assert alloc.allocate(1) is None
    assert alloc.allocate(0) == []
    alloc.free([1, 2])
    assert alloc.num_free == 2
    assert sorted(alloc.allocate(2)) == [1, 2]
    alloc.check_integrity()


def test_double_free_and_foreign_slots_are_refused():
    alloc = SlotAllocator(3)
    slots = alloc.allocate(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="slot 0 is not allocated"):
        alloc.free([0])
    with pytest.raises(ValueError, match="not allocated to any request"):
        alloc.pin([2])
    alloc.check_integrity()
    assert alloc.num_free == 3


def test_free_of_a_pinned_slot_waits_for_the_call_to_end():
    alloc = SlotAllocator(2)
    slots = alloc.allocate(2)
    alloc.pin(slots)  # a call is using them
    alloc.pin([0])  # and a second call uses slot 0
    alloc.free(slots)  # the request gives up (e.g. its call timed out)
    assert alloc.num_free == 0  # but nothing is reusable yet
    with pytest.raises(ValueError, match="double free"):
        alloc.free([0])
    alloc.unpin(slots)  # first call ends: slot 1 is free, slot 0 still used by the second
    assert alloc.num_free == 1 and alloc.allocate(1) == [1]
    alloc.unpin([0])
    assert alloc.num_free == 1 and alloc.allocate(1) == [0]
    alloc.check_integrity()


def test_unpin_without_free_keeps_the_slot_allocated():
    alloc = SlotAllocator(2)
    slots = alloc.allocate(1)
    alloc.pin(slots)
    alloc.unpin(slots)
    assert alloc.num_free == 1
    alloc.free(slots)
    assert alloc.num_free == 2
    alloc.check_integrity()


def test_pins_are_per_call_and_unpin_names_the_call():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(3)
    alloc.pin(slots)  # call A
    alloc.pin(slots[:2])  # call B, on two of the same slots
    with pytest.raises(ValueError, match=r"unpin of slots \[2, 1\] that no call pinned"):
        alloc.unpin([2, 1])  # not the slots of any call (order differs from A's)
    alloc.free(slots)
    assert alloc.num_free == 1  # every slot is still in use by A or B
    alloc.unpin(slots[:2])  # B ends: slots 0 and 1 are still A's
    assert alloc.num_free == 1
    alloc.check_integrity()
    alloc.unpin(slots)  # A ends: the deferred frees complete, lowest slot handed out first
    assert alloc.num_free == 4 and alloc.allocate(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"unpin of slots \[0\] that no call pinned"):
        alloc.unpin([0])
    alloc.check_integrity()


def test_allocate_within_wakes_on_the_free_it_waits_for_and_times_out_without_one():
    alloc = SlotAllocator(2)
    held = alloc.allocate(2)
    assert alloc.allocate_within(1, 0.0) is None  # none free, no wait
    got: list[list[int] | None] = []
    waiter = threading.Thread(target=lambda: got.append(alloc.allocate_within(2, 30.0)))
    waiter.start()
    wait_until(lambda: bool(alloc._freed._waiters), 5, "the waiter blocked")  # type: ignore[attr-defined]
    alloc.free([held[0]])  # one slot is not enough: it keeps waiting
    assert waiter.is_alive() and got == []
    alloc.free([held[1]])
    waiter.join(5)
    assert got == [[1, 0]]  # the last freed is handed out first
    alloc.check_integrity()
