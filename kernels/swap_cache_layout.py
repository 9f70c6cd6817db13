"""Public entry of the kernel package: one call moves K and V of every layer for a set of
blocks between the worker cache and a block-major host buffer (layouts in `kernels.layout`).

    handle = swap_cache_layout(layer_tensors, host, device_block_ids, host_slots, mode)
    handle.wait()

CPU layer tensors (numpy, Paddle CPU) run the numpy implementation synchronously; GPU layer
tensors (Paddle GPU, CuPy, PyTorch) queue one CUDA kernel (or, for long runs of consecutive
blocks, copy-engine DMA) on `stream` and return at once; CuPy is imported only then.
Arguments are validated once, the same way for both (`kernels.swap_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.cpu_swap import swap_on_cpu
from kernels.cuda_swap import DEFAULT_LAUNCH, CudaLaunchConfig, swap_on_cuda
from kernels.layout import HostHeads, SwapLayoutError
from kernels.swap_handle import SwapHandle
from kernels.swap_plan import plan_swap


def swap_cache_layout(
    layer_tensors: Sequence[object],
    host: object,
    device_block_ids: Sequence[int] | np.ndarray,
    host_slots: Sequence[int] | np.ndarray,
    mode: int,
    stream: object = None,
    launch: CudaLaunchConfig = DEFAULT_LAUNCH,
    host_heads: HostHeads | None = None,
) -> SwapHandle:
    """Move the chunks of `device_block_ids` between the cache and the host buffer.

    Args:
        layer_tensors: [K0, V0, K1, V1, ...], each [num_blocks, num_kv_heads, block_size,
            head_dim], C-contiguous, one shape and element size (1, 2 or 4 bytes), one device.
        host: a numpy array, `HostBuffer(ptr, nbytes)` or `DeviceBuffer(ptr, nbytes)`; slot s
            starts at byte s * bytes_per_slot(layer_tensors). For GPU tensors it must be
            page-locked host memory mapped for the device (cudaHostAlloc, or cudaHostRegister
            on it), or a DeviceBuffer on the tensors' GPU (device staging: the same layout in
            GPU memory). A DeviceBuffer with CPU tensors is refused.
        device_block_ids: blocks to move, each in [0, num_blocks).
        host_slots: the host slot of each block, each in [0, host bytes // slot bytes).
        mode: 0 = device -> host (slots must be distinct), 1 = host -> device (block ids must
            be distinct).
        stream: GPU only: None (CuPy's current stream), a cudaStream_t address, a CuPy stream
            or an object with `.cuda_stream` (Paddle, PyTorch).
        launch: GPU only: copy strategy and grid cap (`CudaLaunchConfig`).
        host_heads: the host's blocks hold more KV heads than the cache's (`HostHeads`: the
            cache's are [start, start + num_kv_heads) of total): host slots are that much
            larger and only the cache's heads of each are moved.

    Returns:
        A handle; `wait()` blocks until the bytes have landed (immediate on the CPU).

    Raises:
        SwapLayoutError: an argument is unusable; the message names it.
        ImportError: GPU tensors without CuPy installed.
    """
    plan = plan_swap(layer_tensors, host, device_block_ids, host_slots, mode, host_heads)
    if plan.cache.on_gpu:
        return swap_on_cuda(plan, stream, launch)
    if stream is not None:
        raise SwapLayoutError("stream applies to GPU layer tensors only; these are on the CPU")
    swap_on_cpu(plan)
    return SwapHandle()
