"""swap_cache_layout: move KV blocks between the paged cache and a block-major staging buffer
(host memory, or GPU memory for the device-pointer path)."""

from kernels.cuda_swap import CudaLaunchConfig
from kernels.layout import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    CacheGeometry,
    HostHeads,
    SwapLayoutError,
    slot_bytes,
)
from kernels.swap_cache_layout import swap_cache_layout
from kernels.swap_handle import SwapHandle
from kernels.tensor_refs import DeviceBuffer, HostBuffer, bytes_per_slot

__all__ = [
    "MODE_DEVICE_TO_HOST",
    "MODE_HOST_TO_DEVICE",
    "CacheGeometry",
    "CudaLaunchConfig",
    "DeviceBuffer",
    "HostBuffer",
    "HostHeads",
    "SwapHandle",
    "SwapLayoutError",
    "bytes_per_slot",
    "slot_bytes",
    "swap_cache_layout",
]
