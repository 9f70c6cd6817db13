"""Checksums of pool payloads: xxh3-64 on the host, a word sum on the GPU.

Host staging (CHECKSUM_XXH3): xxh3-64 through the `xxhash` package, 47 GB/s over a 2 MiB slot
on this VM's core, against 25 GB/s for `crc32c` and 17 GB/s for `google-crc32c` (measured
with the same slots; xxh64 ran at 3-9 GB/s). The binding (4.x) lets go of the GIL while it
hashes a large buffer (measured: a Python thread keeps running during a 256 MiB hash), so a
group's slots are hashed on HASH_THREADS threads at once, one slot each: on a GPU host one
core reads cold pinned memory at only 6-7 GB/s, several together near its bandwidth.

Device staging (CHECKSUM_WORDSUM): the payload as little-endian uint32 words w_0..w_{n-1},

    wordsum = sum over i of w_i * (2 i + 1)     mod 2^64

one CUDA pass over the slots of a group (WORDSUM_SOURCE: each thread sums 16-byte loads, a
warp reduces, one atomicAdd per warp into the slot's total). Every weight is odd, so any
change of one word changes the sum (an odd multiple of a nonzero difference below 2^32 is
never 0 mod 2^64), and swapping two unequal words does too. wordsum_reference is the
executable spec: the GPU test compares the kernel with it bit for bit; a host-staging reader
also uses it for an object a GPU worker wrote.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from workers.pool.object_header import CHECKSUM_WORDSUM, CHECKSUM_XXH3


def xxh3(payload: np.ndarray) -> int:
    """xxh3-64 of a contiguous uint8 array."""
    import xxhash

    return xxhash.xxh3_64_intdigest(memoryview(payload))


def wordsum_reference(payload: np.ndarray) -> int:
    """The device checksum of a uint8 array whose length is a multiple of 4, on the CPU."""
    if payload.nbytes % 4:
        raise ValueError(f"wordsum needs whole 32-bit words, got {payload.nbytes} bytes")
    words = payload.view("<u4").astype(np.uint64)  # [n_words]
    weights = np.arange(1, 2 * words.size, 2, dtype=np.uint64)  # 2 i + 1
    with np.errstate(over="ignore"):
        return int(np.sum(words * weights, dtype=np.uint64))


HASH_THREADS = min(8, os.cpu_count() or 1)


@functools.cache
def _hashers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that hash slots (one set per process, started on first use)."""
    return concurrent.futures.ThreadPoolExecutor(HASH_THREADS, "slot-hash")


def host_checksums(view: np.ndarray, slots: Sequence[int], kind: int) -> list[int]:
    """The checksum of each slot's payload in a host staging view [num_slots, slot_bytes]."""
    if kind == CHECKSUM_XXH3:
        if len(slots) < 2 or HASH_THREADS < 2:
            return [xxh3(view[s]) for s in slots]
        return list(_hashers().map(lambda s: xxh3(view[s]), slots))
    if kind == CHECKSUM_WORDSUM:
        return [wordsum_reference(view[s]) for s in slots]
    raise ValueError(f"unknown checksum kind {kind}")


WORDSUM_SOURCE = r"""
extern "C" __global__ void pd_wordsum(const unsigned long long* slot_ptrs,
                                      unsigned long long n_words,
                                      unsigned long long* out) {
    // blockIdx.y: the slot; blockIdx.x, threadIdx.x: a grid-stride loop over its words,
    // four at a time (slots start 16-byte aligned: cudaMalloc + a multiple of 16 per slot).
    const unsigned int* words = (const unsigned int*)slot_ptrs[blockIdx.y];
    unsigned long long n_quads = n_words / 4, acc = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long q = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         q < n_quads; q += stride) {
        uint4 v = ((const uint4*)words)[q];
        unsigned long long i = 4 * q;
        acc += (unsigned long long)v.x * (2 * i + 1) + (unsigned long long)v.y * (2 * i + 3)
             + (unsigned long long)v.z * (2 * i + 5) + (unsigned long long)v.w * (2 * i + 7);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        for (unsigned long long i = 4 * n_quads; i < n_words; ++i)
            acc += (unsigned long long)words[i] * (2 * i + 1);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        acc += __shfl_down_sync(0xffffffff, acc, offset);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.y, acc);
}
"""
_THREADS = 256
_BLOCKS_PER_SLOT = 32  # 64 slots x 32 blocks x 256 threads: enough to fill an H100


class DeviceWordsum:
    """The word sum of device slots, one kernel launch per call (CuPy compiles it once), on
    a non-blocking stream of its own: CuPy's legacy default stream would wait for a blocking
    model stream (the handoff pipeline's copies avoid it for the same reason)."""

    def __init__(self, device_id: int) -> None:
        from kernels.cuda_swap import import_cupy

        self._cp = import_cupy()
        self._device_id = device_id
        with self._cp.cuda.Device(device_id):
            self._kernel = self._cp.RawKernel(WORDSUM_SOURCE, "pd_wordsum")
            self.stream = self._cp.cuda.Stream(non_blocking=True)

    def __call__(self, slot_ptrs: Sequence[int], payload_bytes: int) -> list[int]:
        """The checksum of payload_bytes (a multiple of 4) at each device address."""
        if not slot_ptrs:
            return []
        if payload_bytes % 4:
            raise ValueError(f"wordsum needs whole 32-bit words, got {payload_bytes} bytes")
        cp: Any = self._cp
        with cp.cuda.Device(self._device_id), self.stream:
            ptrs = cp.asarray(np.asarray(slot_ptrs, dtype=np.uint64))
            out = cp.zeros(len(slot_ptrs), dtype=cp.uint64)
            grid = (_BLOCKS_PER_SLOT, len(slot_ptrs))
            self._kernel(grid, (_THREADS,), (ptrs, np.uint64(payload_bytes // 4), out))
            return [int(x) for x in out.get(stream=self.stream)]
