"""Device staging: the device-pointer path's slots, in GPU memory.

    ptr ─► | slot 0 | slot 1 | ... | slot num_slots-1 |      one cudaMalloc on the cache's GPU
            <-slot_bytes->                                  (the host staging's layout)

P gathers a group of blocks into slots here (swap_cache_layout with a DeviceBuffer), waits for
the copy, and puts the slots' device pointers; D gets into slots here and scatters them into
its paged cache. The pool owner then copies over CUDA IPC between these slots and its own
pinned segment (Mooncake's CUDA wheel): no host staging, no single-thread host memcpy
(docs/design/handoff_and_pool.md, the pool section).

Why one cudaMalloc of its own (through CuPy's runtime bindings, as kernels/pinned_host.py
reaches the CUDA runtime), not an array of the cache's framework: the owner maps the memory
behind each pointer through a CUDA IPC handle, which names a whole allocation. A framework's
caching allocator hands out parts of larger blocks that it may free, reuse or move between
pools; one allocation owned here lives exactly as long as this object and is never shared.

With --pool-integrity on (workers/pool/checked_pool.py) a block's payload checksum is the GPU
word sum over its slot here (workers/pool/payload_checksum.py: one kernel for a group's
slots); its header travels through the host staging's header bytes of the same slot number.

device_hook makes the CUDA device current on a thread: Mooncake's client looks a pointer up on
the calling thread, and without the device current there it treats a device pointer as
unknown (-600), so the pool client's call threads run it once when they start
(workers/pool/bounded_call.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np

from kernels.tensor_refs import DeviceBuffer
from workers.pool.object_header import CHECKSUM_WORDSUM
from workers.pool.payload_checksum import DeviceWordsum, host_checksums
from workers.pool.staging import SlotAllocator, StagingBuffer

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses


def _runtime() -> ModuleType:
    from kernels.cuda_swap import import_cupy

    return import_cupy().cuda.runtime


def device_hook(device_id: int | None) -> Callable[[], None] | None:
    """A thread start hook: cudaSetDevice(device_id) on the thread that runs it (None: none,
    a CPU worker's client)."""
    if device_id is None:
        return None

    def bind() -> None:
        _runtime().setDevice(device_id)

    return bind


class DeviceStaging:
    """num_slots * slot_bytes of GPU memory on device_id, with its own SlotAllocator."""

    def __init__(self, num_slots: int, slot_bytes: int, device_id: int) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"need num_slots >= 1 and slot_bytes >= 1, got {num_slots}, {slot_bytes}"
            )
        runtime = _runtime()
        self.num_slots, self.slot_bytes, self.device_id = num_slots, slot_bytes, device_id
        self.nbytes = num_slots * slot_bytes
        before = runtime.getDevice()
        runtime.setDevice(device_id)
        try:
            self.ptr: int = runtime.malloc(self.nbytes)
        finally:
            runtime.setDevice(before)
        self._runtime = runtime
        self.slots = SlotAllocator(num_slots)
        self.slot_ptrs = [self.ptr + s * slot_bytes for s in range(num_slots)]
        # What swap_cache_layout reads and writes (the pipeline's `staging.view`).
        self.view = DeviceBuffer(self.ptr, self.nbytes)
        self.checksum_kind = CHECKSUM_WORDSUM
        self._wordsum: DeviceWordsum | None = None  # compiled on first use

    def checksums(self, slots: Sequence[int], kind: int) -> list[int]:
        """The checksum of each slot's payload: the GPU word sum, or (a block a host-staging
        worker sealed, or slots not 16-byte aligned: rare) the slots copied to the host and
        summed there."""
        if kind == CHECKSUM_WORDSUM and self.slot_bytes % 16 == 0:  # the kernel's 16-byte loads
            if self._wordsum is None:
                self._wordsum = DeviceWordsum(self.device_id)
            return self._wordsum([self._address(s) for s in slots], self.slot_bytes)
        host = np.empty((len(slots), self.slot_bytes), dtype=np.uint8)  # [slots, slot_bytes]
        self._copy(
            [host[row].ctypes.data for row in range(len(slots))], [self._address(s) for s in slots]
        )
        return host_checksums(host, range(len(slots)), kind)

    def to_host(self, slots: Sequence[int], host: StagingBuffer, host_slots: Sequence[int]) -> None:
        """Copy slots into host staging slots (synchronous; the host-staging fallback)."""
        self._copy([host.slot_ptr(h) for h in host_slots], [self._address(s) for s in slots])

    def from_host(
        self, host: StagingBuffer, host_slots: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy host staging slots into slots (synchronous)."""
        self._copy([self._address(s) for s in slots], [host.slot_ptr(h) for h in host_slots])

    def _address(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return self.ptr + slot * self.slot_bytes

    def _copy(self, dsts: list[int], srcs: list[int]) -> None:
        runtime = self._runtime
        runtime.setDevice(self.device_id)
        for dst, src in zip(dsts, srcs, strict=True):
            runtime.memcpy(dst, src, self.slot_bytes, _MEMCPY_DEFAULT)

    def close(self) -> None:
        """Free the memory (the caller made sure no copy or pool call still uses it)."""
        if self.ptr:
            self._runtime.free(self.ptr)
            self.ptr = 0
