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
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.swap_cache_layout import swap_cache_layout
from kernels.tensor_refs import bytes_per_slot, describe_cache

GIB = 1 << 30


def num_host_slots(swap_space_gib: float, slot_bytes: int) -> int:
    """Whole blocks that fit swap_space_gib (0 for a tier that is off)."""
    return int(swap_space_gib * GIB) // slot_bytes


@dataclass(frozen=True)
class SwapCopier:
    """HostCopier over swap_cache_layout; each copy is waited for before it returns."""

    kv_caches: Sequence[Any]  # [K0, V0, K1, V1, ...]
    host: Any  # numpy uint8 array, or kernels.tensor_refs.HostBuffer (pinned)
    slot_bytes: int

    def copy(self, block_ids: list[int], slots: list[int], mode: int) -> None:
        swap_cache_layout(self.kv_caches, self.host, block_ids, slots, mode).wait()


@dataclass
class HostStorage:
    """The buffer and whatever must be released with it (the pinned allocation)."""

    copier: SwapCopier
    num_slots: int
    _pinned: Any = None

    def close(self) -> None:
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
