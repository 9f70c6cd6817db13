"""The host tier's memory and its copies: a block-major buffer of `--swap-space` GiB and the
swap_cache_layout calls between it and the engine's paged cache.

    slot s:  bytes [s * slot_bytes, (s + 1) * slot_bytes)   one block, every layer, K and V
             (kernels/layout.py: the pool staging's layout)

On a CPU engine the buffer is a numpy array. On a GPU engine it is page-locked
(kernels.pinned_host.PinnedHostBuffer): the swap kernel reads and writes mapped pinned memory
only, as the handoff's staging (workers/pool/page_lock.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.cuda_swap import side_stream
from kernels.swap_cache_layout import swap_cache_layout
from kernels.tensor_refs import bytes_per_slot, describe_cache

GIB = 1 << 30


def num_host_slots(swap_space_gib: float, slot_bytes: int) -> int:
    """Whole blocks that fit swap_space_gib (0 for a tier that is off)."""
    return int(swap_space_gib * GIB) // slot_bytes


class SwapCopier:
    """HostCopier over swap_cache_layout. start(): on a GPU the kernel on a side stream of
    its own (as the handoff's copies), on the CPU a helper thread; copy() waits at once."""

    def __init__(self, kv_caches: Sequence[Any], host: Any, slot_bytes: int) -> None:
        self.kv_caches = kv_caches  # [K0, V0, K1, V1, ...]
        self.host = host  # numpy uint8 array, or kernels.tensor_refs.HostBuffer (pinned)
        self.slot_bytes = slot_bytes
        cache = describe_cache(kv_caches)
        self._stream = side_stream(cache) if cache.on_gpu else None
        self._thread = None if cache.on_gpu else ThreadPoolExecutor(1, "host-tier-copy")

    def copy(self, block_ids: list[int], slots: list[int], mode: int) -> None:
        swap_cache_layout(
            self.kv_caches, self.host, block_ids, slots, mode, stream=self._stream
        ).wait()

    def start(self, block_ids: list[int], slots: list[int], mode: int) -> Any:
        if self._thread is None:
            return swap_cache_layout(
                self.kv_caches, self.host, block_ids, slots, mode, stream=self._stream
            )
        return _FutureHandle(self._thread.submit(self.copy, block_ids, slots, mode))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class _FutureHandle:
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


@dataclass
class HostStorage:
    """The buffer and whatever must be released with it (the pinned allocation)."""

    copier: SwapCopier
    num_slots: int
    _pinned: Any = None

    def close(self) -> None:
        self.copier.close()
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None


def open_host_storage(kv_caches: Sequence[Any], swap_space_gib: float) -> HostStorage | None:
    """The tier's memory for this cache, or None when swap_space_gib holds no whole block."""
    slot_bytes = bytes_per_slot(kv_caches)
    num_slots = num_host_slots(swap_space_gib, slot_bytes)
    if num_slots < 1:
        return None
    nbytes = num_slots * slot_bytes
    if describe_cache(kv_caches).on_gpu:
        from kernels.pinned_host import PinnedHostBuffer

        pinned = PinnedHostBuffer(nbytes)
        return HostStorage(SwapCopier(kv_caches, pinned.buffer, slot_bytes), num_slots, pinned)
    host = np.zeros(nbytes, dtype=np.uint8)  # [num_slots * slot_bytes]
    return HostStorage(SwapCopier(kv_caches, host, slot_bytes), num_slots)
