"""DMA path of swap_cache_layout: copy engines instead of SMs.

One cudaMemcpy2DAsync per (layer tensor, run), where a run is a stretch of consecutive block
ids going to consecutive host slots. On the device such a run of one tensor is contiguous
(blocks b..b+n-1); on the host its chunks sit one slot apart, which is exactly a 2-D copy:

    device  [ b | b+1 | b+2 ]            pitch chunk_bytes
               \\    \\     \\
    host    [ s: K0 .. | s+1: K0 .. | s+2: K0 .. ]   pitch slot_bytes, width chunk_bytes

With host_heads the host chunks are larger (kernels/layout.py): the same copies, the host
side's pitch its slot and its start the cache's heads inside the chunk.

The copy engines leave every SM to model compute, but each call has a fixed cost of a few
microseconds, so this only pays when runs are long (measured in `python -m
benchmarks.kernels.bench`); scattered blocks make it one call per chunk, FastDeploy's pattern, which
the kernel beats.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from kernels.layout import MODE_DEVICE_TO_HOST
from kernels.swap_plan import SwapPlan

_DEVICE_TO_HOST, _HOST_TO_DEVICE, _DEVICE_TO_DEVICE = 2, 1, 3  # cudaMemcpyKind


def contiguous_runs(block_ids: np.ndarray, host_slots: np.ndarray) -> np.ndarray:
    """[num_runs, 3] int64 rows (first block id, first slot, length) covering the items in
    order; a run continues while both the block id and the slot go up by one."""
    if block_ids.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    step = (np.diff(block_ids) != 1) | (np.diff(host_slots) != 1)
    starts = np.concatenate([[0], np.flatnonzero(step) + 1])
    lengths = np.diff(np.concatenate([starts, [block_ids.size]]))
    return np.stack([block_ids[starts], host_slots[starts], lengths], axis=1)


def mean_run_bytes(plan: SwapPlan) -> float:
    """Average bytes of one layer tensor's run: what a single DMA call would move."""
    num_runs = contiguous_runs(plan.block_ids, plan.host_slots).shape[0]
    return plan.num_items * plan.geometry.chunk_bytes / max(1, num_runs)


def swap_with_dma(cupy: ModuleType, plan: SwapPlan, stream_ptr: int) -> None:
    """Queue the plan as 2-D copies on the stream (host memory must be page-locked)."""
    memcpy_2d = cupy.cuda.runtime.memcpy2DAsync
    chunk_bytes, host_chunk = plan.geometry.chunk_bytes, plan.host_chunk_bytes
    slot_bytes, offset = plan.host_slot_bytes, plan.host_offset_bytes
    num_tensors = plan.geometry.num_tensors
    to_host = plan.mode == MODE_DEVICE_TO_HOST
    out_kind = _DEVICE_TO_DEVICE if plan.host.on_gpu else _DEVICE_TO_HOST
    in_kind = _DEVICE_TO_DEVICE if plan.host.on_gpu else _HOST_TO_DEVICE
    for block_id, slot, length in contiguous_runs(plan.block_ids, plan.host_slots).tolist():
        for j, tensor in enumerate(plan.cache.tensors):
            device = tensor.ptr + block_id * chunk_bytes
            host = plan.host.ptr + (slot * num_tensors + j) * host_chunk + offset
            if to_host:
                memcpy_2d(
                    host, slot_bytes, device, chunk_bytes, chunk_bytes, length, out_kind, stream_ptr
                )
            else:
                memcpy_2d(
                    device, chunk_bytes, host, slot_bytes, chunk_bytes, length, in_kind, stream_ptr
                )
