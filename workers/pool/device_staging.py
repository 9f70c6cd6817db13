"""Device staging: the device-pointer path's slots, in GPU memory.

    ptr ─► | slot 0 | slot 1 | ... | slot num_slots-1 | hdr 0 | ... |   one cudaMalloc on
            <-slot_bytes->                                              the cache's GPU (the
                                                                        host staging's layout)

A pool object's header (workers/pool/object_header.py) is sealed and checked on the host: its
64 bytes go to and from the header region in one copy per run of consecutive slots, and
the payload's checksum is the GPU word sum (workers/pool/payload_checksum.py), one kernel
over a group's slots.

P gathers a group of blocks into slots here (swap_cache_layout with a DeviceBuffer), waits for
the copy, and puts the slots' device pointers; D gets into slots here and scatters them into
its paged cache. The pool owner then copies over CUDA IPC between these slots and its own
pinned segment (Mooncake's CUDA wheel): no host staging, no single-thread host memcpy
(docs/architecture.md, the pool section).

Why one cudaMalloc of its own (through CuPy's runtime bindings, as kernels/pinned_host.py
reaches the CUDA runtime), not an array of the cache's framework: the owner maps the memory
behind each pointer through a CUDA IPC handle, which names a whole allocation. A framework's
caching allocator hands out parts of larger blocks that it may free, reuse or move between
pools; one allocation owned here lives exactly as long as this object and is never shared.

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
from workers.pool.object_header import CHECKSUM_WORDSUM, HEADER_BYTES
from workers.pool.payload_checksum import DeviceWordsum, host_checksums
from workers.pool.staging import SlotAllocator, StagingBuffer, staging_bytes

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking


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
        self.nbytes = staging_bytes(num_slots, slot_bytes)
        before = runtime.getDevice()
        runtime.setDevice(device_id)
        try:
            self.ptr: int = runtime.malloc(self.nbytes)
            # Header copies go on a non-blocking stream: a plain cudaMemcpy runs on the legacy
            # default stream, which waits for a blocking model stream's compute.
            self._header_stream = runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING)
        finally:
            runtime.setDevice(before)
        self._runtime = runtime
        self.slots = SlotAllocator(num_slots)
        self.slot_ptrs = [self.ptr + s * slot_bytes for s in range(num_slots)]
        headers_at = self.ptr + num_slots * slot_bytes
        self.header_ptrs = [headers_at + s * HEADER_BYTES for s in range(num_slots)]
        # What swap_cache_layout reads and writes (the pipeline's `staging.view`): the slots.
        self.view = DeviceBuffer(self.ptr, num_slots * slot_bytes)
        self._wordsum: DeviceWordsum | None = None  # compiled on first use
        self.checksum_kind = CHECKSUM_WORDSUM

    def checksums(self, slots: Sequence[int], kind: int) -> list[int]:
        """The checksum of each slot's payload: the GPU word sum, or (an object a host-staging
        worker wrote, rare) the slots copied to the host and summed there."""
        if kind == CHECKSUM_WORDSUM:
            if self._wordsum is None:
                self._wordsum = DeviceWordsum(self.device_id)
            return self._wordsum([self._address(s) for s in slots], self.slot_bytes)
        host = np.empty((len(slots), self.slot_bytes), dtype=np.uint8)  # [slots, slot_bytes]
        for row, slot in enumerate(slots):
            self._copy([host[row].ctypes.data], [self._address(slot)], self.slot_bytes)
        return host_checksums(host, range(len(slots)), kind)

    def write_headers(self, slots: Sequence[int], headers: Sequence[bytes]) -> None:
        """Copy each header into its slot's header bytes (one copy per run of slots)."""
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        packed = np.frombuffer(b"".join(headers[i] for i in order), dtype=np.uint8)
        for first, count, at in _runs([slots[i] for i in order]):
            src = packed[at * HEADER_BYTES :]
            self._copy_header(self.header_ptrs[first], src.ctypes.data, count * HEADER_BYTES)
        self._runtime.streamSynchronize(self._header_stream)

    def read_headers(self, slots: Sequence[int]) -> list[bytes]:
        """Each slot's header bytes (one copy per run of slots)."""
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        packed = np.empty(len(slots) * HEADER_BYTES, dtype=np.uint8)
        for first, count, at in _runs([slots[i] for i in order]):
            dst = packed[at * HEADER_BYTES :]
            self._copy_header(dst.ctypes.data, self.header_ptrs[first], count * HEADER_BYTES)
        self._runtime.streamSynchronize(self._header_stream)
        out = [b""] * len(slots)
        for rank, i in enumerate(order):
            out[i] = packed[rank * HEADER_BYTES : (rank + 1) * HEADER_BYTES].tobytes()
        return out

    def to_host(self, slots: Sequence[int], host: StagingBuffer, host_slots: Sequence[int]) -> None:
        """Copy slots and their headers into host staging slots (synchronous; the
        host-staging fallback)."""
        self._copy([host.slot_ptr(h) for h in host_slots], [self._address(s) for s in slots])
        self._copy(
            [host.header_ptrs[h] for h in host_slots],
            [self.header_ptrs[s] for s in slots],
            HEADER_BYTES,
        )

    def from_host(
        self, host: StagingBuffer, host_slots: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy host staging slots and their headers into slots (synchronous)."""
        self._copy([self._address(s) for s in slots], [host.slot_ptr(h) for h in host_slots])
        self._copy(
            [self.header_ptrs[s] for s in slots],
            [host.header_ptrs[h] for h in host_slots],
            HEADER_BYTES,
        )

    def _address(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return self.ptr + slot * self.slot_bytes

    def _copy_header(self, dst: int, src: int, nbytes: int) -> None:
        self._runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, self._header_stream)

    def _copy(self, dsts: list[int], srcs: list[int], nbytes: int | None = None) -> None:
        runtime = self._runtime
        runtime.setDevice(self.device_id)
        for dst, src in zip(dsts, srcs, strict=True):
            runtime.memcpy(dst, src, nbytes or self.slot_bytes, _MEMCPY_DEFAULT)

    def close(self) -> None:
        """Free the memory (the caller made sure no copy or pool call still uses it)."""
        if self._header_stream:
            self._runtime.streamDestroy(self._header_stream)
            self._header_stream = 0
        if self.ptr:
            self._runtime.free(self.ptr)
            self.ptr = 0


def _runs(sorted_slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, count, index of first) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(sorted_slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, at = runs[-1]
            runs[-1] = (first, count + 1, at)
        else:
            runs.append((slot, 1, index))
    return runs
