"""The host staging buffer that pool transfers go through, and its slot allocator.

One buffer per client, registered with Mooncake once. It is cut into equal slots of
slot_bytes, one pool object (one KV block of every layer) per slot:

    ptr ─► | slot 0 | slot 1 | ... | slot num_slots-1 | hdr 0 | hdr 1 | ... |
            <-slot_bytes->                                <-HEADER_BYTES->
    slot s covers bytes [s * slot_bytes, (s + 1) * slot_bytes)
    its header bytes    [num_slots * slot_bytes + s * HEADER_BYTES, ... + HEADER_BYTES)

A block is two pool objects: its payload from the slot, and its header (workers/pool/
object_header.py) from the slot's header bytes under the key's header key; the headers sit
after every slot so that the payloads keep the layout swap_cache_layout addresses (slot s at
s * slot_bytes, aligned). A device staging's slots use these header bytes too (by slot number).

The prefill worker fills slots (device -> host) and puts them; the decode worker gets into
slots and copies them to the device. Several requests share the buffer through SlotAllocator,
which hands out slots and answers None when none are free: the buffer never grows.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from workers.pool.object_header import CHECKSUM_XXH3, HEADER_BYTES
from workers.pool.payload_checksum import host_checksums


class StagingBuffer:
    """num_slots * (slot_bytes + HEADER_BYTES) of host memory, as a raw pointer, a numpy
    uint8 view of the slots and one of their headers.

    With ptr=None it maps fresh anonymous memory (page aligned, zero filled). With ptr given
    it wraps memory someone else allocated (Mooncake's shared-memory pool) and must outlive
    this object.
    """

    def __init__(self, num_slots: int, slot_bytes: int, ptr: int | None = None) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"need num_slots >= 1 and slot_bytes >= 1, got {num_slots}, {slot_bytes}"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.nbytes = staging_bytes(num_slots, slot_bytes)
        if ptr is None:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, self.nbytes)
            raw = np.frombuffer(self._mmap, dtype=np.uint8)
            self.ptr = raw.ctypes.data
        else:
            self._mmap = None
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(ptr))
            self.ptr = ptr
        payload_end = num_slots * slot_bytes
        # [num_slots, slot_bytes]
        self.view: np.ndarray = raw[:payload_end].reshape(num_slots, slot_bytes)
        # [num_slots, HEADER_BYTES]
        self.headers: np.ndarray = raw[payload_end:].reshape(num_slots, HEADER_BYTES)
        self.slot_ptrs = [self.ptr + s * slot_bytes for s in range(num_slots)]
        self.header_ptrs = [self.ptr + payload_end + s * HEADER_BYTES for s in range(num_slots)]

    def slot_ptr(self, slot: int) -> int:
        """Address of the first byte of slot."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return self.ptr + slot * self.slot_bytes

    def slot(self, slot: int) -> np.ndarray:
        """A writable uint8 view of one slot (no copy)."""
        return self.view[slot]

    def checksums(self, slots: Sequence[int], kind: int) -> list[int]:
        """The checksum of each slot's payload (workers/pool/payload_checksum.py)."""
        return host_checksums(self.view, slots, kind)

    @property
    def checksum_kind(self) -> int:
        """The checksum a writer puts in headers sealed here: xxh3 (a host buffer)."""
        return CHECKSUM_XXH3

    def write_headers(self, slots: Sequence[int], headers: np.ndarray) -> None:
        """headers [len(slots), HEADER_BYTES] into the slots' header bytes."""
        self.headers[list(slots)] = headers

    def read_headers(self, slots: Sequence[int]) -> np.ndarray:
        """[len(slots), HEADER_BYTES]: a copy of the slots' header bytes."""
        return self.headers[list(slots)]


def staging_bytes(num_slots: int, slot_bytes: int) -> int:
    """Bytes of a staging of num_slots slots: the payloads, then one header per slot."""
    return num_slots * (slot_bytes + HEADER_BYTES)


class SlotAllocator:
    """Hands out staging slots to concurrent requests; thread safe.

    A slot taking part in a Mooncake call is pinned for the call's duration. Freeing a pinned
    slot defers the free until the call ends, so a call that outlived its time bound can never
    write into a slot that was given to another request meanwhile.

    Pins are kept per call (one entry per pin(), a few calls in flight at most), not per slot:
    pin and unpin are then a set check and a list append/remove, with no per-slot Python loop
    on the data path; free() and check_integrity() take the union when they need it.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # allocate_within waits on it
        # Lowest slots first keeps a lightly loaded worker's transfers in one hot region.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._allocated: set[int] = set()
        self._pinned: list[tuple[int, ...]] = []  # the slots of each call in flight
        self._free_when_unpinned: set[int] = set()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def allocate_within(self, num_slots: int, timeout_s: float) -> list[int] | None:
        """num_slots slots as soon as that many are free, waiting up to timeout_s (woken by
        each free, never polling); None when they did not come free in time."""
        deadline_s = time.monotonic() + timeout_s
        with self._freed:
            while (slots := self._allocate_locked(num_slots)) is None:
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    return None
                self._freed.wait(left_s)
            return slots

    def allocate(self, num_slots: int) -> list[int] | None:
        """num_slots slots, or None when fewer are free (all or nothing, never blocks)."""
        with self._lock:
            return self._allocate_locked(num_slots)

    def _allocate_locked(self, num_slots: int) -> list[int] | None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if num_slots > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(num_slots)]
        self._allocated.update(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Give slots back; raises ValueError for a slot that is not allocated."""
        with self._lock:
            slots = list(slots)
            for slot in slots:
                if slot not in self._allocated or slot in self._free_when_unpinned:
                    raise ValueError(f"slot {slot} is not allocated (double free?)")
            pinned = self._pinned_slots()
            for slot in slots:
                if slot in pinned:
                    self._free_when_unpinned.add(slot)
                else:
                    self._release(slot)

    def pin(self, slots: Iterable[int]) -> None:
        """Mark slots as used by a call in flight; raises ValueError for unallocated slots."""
        slots = tuple(slots)
        with self._lock:
            if not self._allocated.issuperset(slots):
                slot = min(set(slots) - self._allocated)
                raise ValueError(f"slot {slot} is not allocated to any request")
            self._pinned.append(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        """The call that pinned exactly these slots (same order) ended; complete any free
        that waited for it. Raises ValueError if no call pinned them."""
        slots = tuple(slots)
        with self._lock:
            try:
                self._pinned.remove(slots)
            except ValueError:
                raise ValueError(f"unpin of slots {list(slots)} that no call pinned") from None
            if self._free_when_unpinned:
                ready = self._free_when_unpinned - self._pinned_slots()
                self._free_when_unpinned -= ready
                for slot in sorted(ready, reverse=True):  # the lowest is handed out first
                    self._release(slot)

    def _pinned_slots(self) -> set[int]:
        return set().union(*self._pinned)

    def _release(self, slot: int) -> None:
        self._allocated.discard(slot)
        self._free.append(slot)
        self._freed.notify_all()

    def check_integrity(self) -> None:
        """Assert every slot is exactly one of free / allocated, pins only on allocated."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a slot is on the free list twice"
            assert not free & self._allocated, (
                f"slots both free and allocated: {free & self._allocated}"
            )
            assert free | self._allocated == set(range(self.num_slots)), "a slot was lost"
            pinned = self._pinned_slots()
            assert pinned <= self._allocated, f"free slots pinned: {pinned - self._allocated}"
            assert self._free_when_unpinned <= pinned, "deferred free of an unpinned slot"


def batch_sizes(
    keys: Sequence[str], slots: Sequence[int], sizes_bytes: Sequence[int] | None, slot_bytes: int
) -> list[int]:
    """The bytes of each key of a batch call (default: whole slots), checked: one distinct
    slot per key, each size in (0, slot_bytes]; ValueError naming what is wrong."""
    if len(keys) != len(slots):
        raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one batch: {list(slots)}")
    if sizes_bytes is None:
        return [slot_bytes] * len(keys)
    if len(sizes_bytes) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(sizes_bytes)} sizes")
    for size in sizes_bytes:
        if not 0 < size <= slot_bytes:
            raise ValueError(f"size {size} outside (0, slot_bytes={slot_bytes}]")
    return list(sizes_bytes)


@dataclass(frozen=True)
class Target:
    """Where one batch call's slots are: their addresses (a staging's slots, or the host
    staging's header bytes) and the allocator whose slots the call pins (None: the call pins
    nothing, as for headers addressed by another staging's slot numbers)."""

    ptrs: list[int]
    slots: SlotAllocator | None

    def args(self, slots: Sequence[int], sizes: list[int]) -> tuple[list[int], list[int]]:
        """The native call's addresses and lengths for these slots."""
        ptrs = self.ptrs
        return [ptrs[s] for s in slots], sizes
