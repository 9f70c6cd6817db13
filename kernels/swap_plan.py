"""Validation shared by the CPU and CUDA paths: every argument checked once, in one place.

`plan_swap` turns the public arguments into a `SwapPlan` whose fields the implementations can
trust: ids and slots are in range, the host buffer holds every slot, destinations are unique
(two writers of one chunk would race on the GPU and make the result order-dependent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels.layout import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    CacheGeometry,
    HostHeads,
    SwapLayoutError,
)
from kernels.tensor_refs import CacheRef, HostRef, describe_cache, describe_host


@dataclass(frozen=True)
class SwapPlan:
    """A validated swap: what to move, between which buffers, in which direction."""

    cache: CacheRef
    host: HostRef
    block_ids: np.ndarray  # [num_items] int64, each in [0, num_blocks)
    host_slots: np.ndarray  # [num_items] int64, each in [0, num_host_slots)
    mode: int
    host_heads: HostHeads | None = None  # the host's blocks hold more heads than the cache's

    @property
    def geometry(self) -> CacheGeometry:
        return self.cache.geometry

    @property
    def host_chunk_bytes(self) -> int:
        """One layer's K (or V) of one host slot: the cache's chunk unless host_heads."""
        g = self.geometry
        heads = g.num_kv_heads if self.host_heads is None else self.host_heads.total
        return g.chunk_bytes // g.num_kv_heads * heads

    @property
    def host_slot_bytes(self) -> int:
        """One host slot: every layer's K and V of one block."""
        return self.geometry.num_tensors * self.host_chunk_bytes

    @property
    def host_offset_bytes(self) -> int:
        """Where the cache's heads start inside a host chunk."""
        g = self.geometry
        start = 0 if self.host_heads is None else self.host_heads.start
        return g.chunk_bytes // g.num_kv_heads * start

    @property
    def num_items(self) -> int:
        """Blocks moved by this call."""
        return int(self.block_ids.shape[0])

    @property
    def num_bytes(self) -> int:
        """Bytes moved by this call (each direction counts once)."""
        return self.num_items * self.geometry.slot_bytes


def _as_index_array(values: object, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise SwapLayoutError(f"{name} must be a 1-D sequence of ints, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise SwapLayoutError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=True)


def _check_range(array: np.ndarray, name: str, limit: int, what: str) -> None:
    if array.size == 0 or (array.min() >= 0 and array.max() < limit):
        return  # the common case, without building index arrays
    first = int(np.flatnonzero((array < 0) | (array >= limit))[0])
    raise SwapLayoutError(
        f"{name}[{first}] = {int(array[first])} is out of range [0, {limit}): {what}"
    )


def _check_unique(array: np.ndarray, name: str, why: str) -> None:
    ordered = np.sort(array)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise SwapLayoutError(f"{name} repeats {int(repeated[0])}: {why}")


def plan_swap(
    layer_tensors: Sequence[object],
    host: object,
    device_block_ids: Sequence[int] | np.ndarray,
    host_slots: Sequence[int] | np.ndarray,
    mode: int,
    host_heads: HostHeads | None = None,
) -> SwapPlan:
    """Check every argument of swap_cache_layout and return the plan both paths execute."""
    if isinstance(mode, bool) or mode not in (MODE_DEVICE_TO_HOST, MODE_HOST_TO_DEVICE):
        raise SwapLayoutError(
            f"mode must be {MODE_DEVICE_TO_HOST} (device -> host) or {MODE_HOST_TO_DEVICE} "
            f"(host -> device), got {mode!r}"
        )
    cache = describe_cache(layer_tensors)
    host_ref = describe_host(host)
    if host_ref.on_gpu and not cache.on_gpu:
        raise SwapLayoutError(
            "host is a DeviceBuffer (GPU staging) but the layer tensors are on the CPU"
        )
    geometry = cache.geometry
    if host_heads is not None:
        host_heads.check(geometry.num_kv_heads)
    if host_ref.ptr % geometry.elem_bytes:
        raise SwapLayoutError(
            f"host buffer address {host_ref.ptr:#x} is not aligned to the cache's "
            f"{geometry.elem_bytes}-byte elements"
        )
    if mode == MODE_DEVICE_TO_HOST and not host_ref.writable:
        raise SwapLayoutError("host buffer is read-only but mode 0 (device -> host) writes it")
    block_ids = _as_index_array(device_block_ids, "device_block_ids")
    slots = _as_index_array(host_slots, "host_slots")
    if block_ids.shape != slots.shape:
        raise SwapLayoutError(
            f"device_block_ids has {block_ids.shape[0]} entries but host_slots has "
            f"{slots.shape[0]}: one slot per block"
        )
    plan = SwapPlan(cache, host_ref, block_ids, slots, mode, host_heads)
    host_slot_bytes = plan.host_slot_bytes
    num_host_slots = host_ref.nbytes // host_slot_bytes
    if block_ids.size and num_host_slots == 0:
        raise SwapLayoutError(
            f"host buffer of {host_ref.nbytes} bytes is smaller than one slot "
            f"({host_slot_bytes} bytes)"
        )
    _check_range(
        block_ids,
        "device_block_ids",
        geometry.num_blocks,
        f"the cache has {geometry.num_blocks} blocks",
    )
    _check_range(
        slots,
        "host_slots",
        num_host_slots,
        f"the host buffer of {host_ref.nbytes} bytes holds {num_host_slots} slots of "
        f"{host_slot_bytes} bytes",
    )
    if mode == MODE_DEVICE_TO_HOST:
        _check_unique(slots, "host_slots", "two blocks would be written into one host slot")
    else:
        _check_unique(block_ids, "device_block_ids", "two slots would be written into one block")
    return plan
