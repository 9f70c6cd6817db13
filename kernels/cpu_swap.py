"""CPU implementation of swap_cache_layout: the executable spec the CUDA kernel must match.

Works on byte views of the caller's memory (numpy arrays, Paddle CPU tensors through dlpack,
raw host pointers), so nothing is copied except the chunks themselves. Chunks are opaque
bytes: the dtype only fixes the element size, and bit patterns (NaNs included) survive.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernels.layout import MODE_DEVICE_TO_HOST
from kernels.swap_plan import SwapPlan
from kernels.tensor_refs import HostRef


def _host_bytes(host: HostRef) -> np.ndarray:
    """Flat uint8 view of the host buffer, also when it arrived as a raw pointer."""
    if host.host_bytes is not None:
        return host.host_bytes
    raw = (ctypes.c_uint8 * host.nbytes).from_address(host.ptr)
    return np.ctypeslib.as_array(raw)


def swap_on_cpu(plan: SwapPlan) -> None:
    """Move every chunk of the plan, synchronously.

    For item i and layer tensor j (= 2 * layer + kv), with the cache's part of a host chunk
    at [off, off + chunk_bytes) (off 0 and host chunks of chunk_bytes unless plan.host_heads):
        mode 0: host[slot_i, j, off:off + chunk_bytes] = cache[j][block_i, :]
        mode 1: cache[j][block_i, :] = host[slot_i, j, off:off + chunk_bytes]
    with host viewed as [num_host_slots, 2 * num_layers, host_chunk_bytes] and cache[j] as
    [num_blocks, chunk_bytes].
    """
    assert not plan.cache.on_gpu, "swap_on_cpu needs CPU layer tensors"
    if plan.num_items == 0:
        return
    geometry = plan.geometry
    chunk_bytes, off = geometry.chunk_bytes, plan.host_offset_bytes
    num_host_slots = plan.host.nbytes // plan.host_slot_bytes
    host = _host_bytes(plan.host)[: num_host_slots * plan.host_slot_bytes]
    # [num_host_slots, 2 * num_layers, host_chunk_bytes]
    host_chunks = host.reshape(num_host_slots, geometry.num_tensors, plan.host_chunk_bytes)
    for j, tensor in enumerate(plan.cache.tensors):
        assert tensor.host_bytes is not None
        # [num_blocks, chunk_bytes]
        cache_chunks = tensor.host_bytes.reshape(geometry.num_blocks, chunk_bytes)
        if plan.mode == MODE_DEVICE_TO_HOST:
            host_chunks[plan.host_slots, j, off : off + chunk_bytes] = cache_chunks[plan.block_ids]
        else:
            cache_chunks[plan.block_ids] = host_chunks[plan.host_slots, j, off : off + chunk_bytes]
