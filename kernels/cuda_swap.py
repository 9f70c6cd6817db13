"""CUDA path of swap_cache_layout: compiles swap_cache_layout.cu with NVRTC (through CuPy) at
first use and launches it on the caller's stream with raw addresses.

Raw addresses make the launcher framework-neutral: Paddle GPU tensors (`data_ptr()`, Paddle's
stream handle), CuPy and PyTorch arrays all reduce to integers. CuPy is imported only here,
and only when a GPU tensor arrives, so CPU-only machines never need it.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from kernels.dma_swap import mean_run_bytes, swap_with_dma
from kernels.layout import SwapLayoutError
from kernels.swap_handle import CudaSwapHandle, SwapHandle
from kernels.swap_plan import SwapPlan
from kernels.tensor_refs import CacheRef

_KERNEL_SOURCE = Path(__file__).with_name("swap_cache_layout.cu")
_VEC_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_PIECE_VECS = 32 * 8  # SWAP_WARP * SWAP_UNROLL in the .cu: the vectors one warp moves a step
# cudaPointerAttributes.type values
_MEMORY_HOST, _MEMORY_DEVICE, _MEMORY_MANAGED = 1, 2, 3


@dataclass(frozen=True)
class CudaLaunchConfig:
    """How the GPU path moves bytes; defaults chosen from `python -m benchmarks.kernels.bench`.

    strategy: "kernel" (SMs copy through mapped host memory: one launch whatever the block
    pattern), "dma" (copy engines, one 2-D copy per run of consecutive blocks: no SM taken
    from compute, but a fixed cost per call and per row), or "auto": dma when chunks are at
    least `dma_min_chunk_bytes` and one copy call (a run of one layer tensor) moves at least
    `dma_min_run_bytes` on average, else kernel. Measured on an H100: 2-D DMA of long runs
    of >= 64 KiB chunks reaches 0.96-1.00 of a bulk copy (kernel ~0.92); 1 MiB chunks copied
    one by one 0.87-0.89, a few percent under the kernel but with no SM taken from compute.
    max_ctas: the kernel's grid cap, i.e. how many SMs it may take from model compute. On an
    H100, 2 CTAs of 512 threads already move as much as any larger grid (PCIe is the limit)
    and left a concurrent fp16 GEMM at full speed, while 4 CTAs cost it ~19% and 8 ~32%
    (docs/benchmarks/kernels.md): keep it small. device_max_ctas: the same cap when the
    staging is GPU memory (the device-pointer path): no PCIe link bounds that copy, so more
    CTAs finish it sooner and hold their SMs for less time (docs/benchmarks/handoff.md).
    """

    strategy: str = "auto"
    threads_per_cta: int = 512
    max_ctas: int = 2
    device_max_ctas: int = 16
    dma_min_chunk_bytes: int = 64 << 10
    dma_min_run_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.strategy not in ("kernel", "dma", "auto"):
            raise SwapLayoutError(f"strategy must be kernel, dma or auto, got {self.strategy!r}")
        if self.threads_per_cta % 32 or not 32 <= self.threads_per_cta <= 1024:
            raise SwapLayoutError(
                f"threads_per_cta must be a multiple of 32 in [32, 1024], "
                f"got {self.threads_per_cta}"
            )
        if min(self.max_ctas, self.device_max_ctas) < 1:
            raise SwapLayoutError(
                f"max_ctas ({self.max_ctas}) and device_max_ctas ({self.device_max_ctas}) "
                "must be positive"
            )
        if min(self.dma_min_chunk_bytes, self.dma_min_run_bytes) < 0:
            raise SwapLayoutError("dma_min_chunk_bytes and dma_min_run_bytes must be >= 0")


DEFAULT_LAUNCH = CudaLaunchConfig()


def import_cupy() -> ModuleType:
    """CuPy, or an ImportError that says what to install."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "swap_cache_layout on GPU tensors needs CuPy: pip install cupy-cuda12x "
            "(CUDA 12) or cupy-cuda13x (CUDA 13)"
        ) from exc
    return cupy


def _kernel_name(vec_bytes: int, mode: int) -> str:
    return f"swap_cache_layout_kernel<{_VEC_TYPES[vec_bytes]}, {mode}>"


@functools.cache
def _kernels(device_id: int) -> dict[tuple[int, int], object]:
    """Every (vector width, mode) instantiation, compiled once per device (NVRTC)."""
    cupy = import_cupy()
    names = [_kernel_name(v, m) for v in _VEC_TYPES for m in (0, 1)]
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(
            code=_KERNEL_SOURCE.read_text(), options=("--std=c++17",), name_expressions=names
        )
        return {(v, m): module.get_function(_kernel_name(v, m)) for v in _VEC_TYPES for m in (0, 1)}


class _StreamAddress:
    """A raw cudaStream_t in the CUDA stream protocol (`__cuda_stream__`: version 0, handle)."""

    def __init__(self, address: int) -> None:
        self.address = address

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.address)


def _external_stream(cupy: ModuleType, address: int) -> object:
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14 deprecates ExternalStream for this
        return from_external(_StreamAddress(address))
    return cupy.cuda.ExternalStream(address)


def resolve_stream(cupy: ModuleType, stream: object) -> object:
    """A CuPy stream object for: None (CuPy's current stream), a raw cudaStream_t int, a CuPy
    stream, or any object with `cuda_stream` (PyTorch, Paddle) or `ptr`."""
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return _external_stream(cupy, int(getattr(stream, attr)))
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _external_stream(cupy, stream)
    raise SwapLayoutError(
        f"stream is a {type(stream).__qualname__}; pass None, a cudaStream_t address (int), "
        "a CuPy stream, or an object with .cuda_stream"
    )


def _memory_type(attrs: object) -> int:
    # CuPy renamed cudaPointerAttributes' field from memoryType to type (as CUDA did).
    return int(getattr(attrs, "type", getattr(attrs, "memoryType", -1)))


def device_of_cache(cupy: ModuleType, cache: CacheRef) -> int:
    """The GPU the cache's tensors live on (SwapLayoutError if not one GPU)."""
    device_id = -1
    for j, tensor in enumerate(cache.tensors):
        attrs = cupy.cuda.runtime.pointerGetAttributes(tensor.ptr)
        if _memory_type(attrs) not in (_MEMORY_DEVICE, _MEMORY_MANAGED):
            raise SwapLayoutError(f"layer_tensors[{j}] at {tensor.ptr:#x} is not GPU memory")
        if device_id not in (-1, attrs.device):
            raise SwapLayoutError(
                f"layer_tensors[{j}] is on GPU {attrs.device}, layer_tensors[0] on GPU {device_id}"
            )
        device_id = attrs.device
    return device_id


def side_stream(cache: CacheRef) -> object:
    """A new non-blocking CUDA stream on the cache's device: copies queued on it neither wait
    for the model's stream (even one created blocking, which the legacy default stream would
    wait for) nor hold it up. The caller orders them after the compute that wrote the blocks."""
    cupy = import_cupy()
    with cupy.cuda.Device(device_of_cache(cupy, cache)):
        return cupy.cuda.Stream(non_blocking=True)


def _staging_address(cupy: ModuleType, plan: SwapPlan, device_id: int) -> int:
    """The device-side address of the staging: a DeviceBuffer's own (GPU memory of the cache's
    device), or a host buffer's mapping, which must be page-locked and mapped over the whole
    range the call touches, or the kernel would fault."""
    used_bytes = (int(plan.host_slots.max()) + 1) * plan.host_slot_bytes
    first = cupy.cuda.runtime.pointerGetAttributes(plan.host.ptr)
    last = cupy.cuda.runtime.pointerGetAttributes(plan.host.ptr + used_bytes - 1)
    if plan.host.on_gpu:
        if _memory_type(first) != _MEMORY_DEVICE or _memory_type(last) != _MEMORY_DEVICE:
            raise SwapLayoutError(
                f"device buffer [{plan.host.ptr:#x}, +{used_bytes}) is not GPU memory"
            )
        if first.device != device_id:
            raise SwapLayoutError(
                f"device buffer is on GPU {first.device}, the layer tensors on GPU {device_id}"
            )
        return plan.host.ptr
    if _memory_type(first) != _MEMORY_HOST or _memory_type(last) != _MEMORY_HOST:
        raise SwapLayoutError(
            f"host buffer [{plan.host.ptr:#x}, +{used_bytes}) is not page-locked host memory: "
            "allocate it with cudaHostAlloc(cudaHostAllocMapped) or register it with "
            "cudaHostRegister before the GPU kernel can read or write it"
        )
    if last.devicePointer - first.devicePointer != used_bytes - 1:
        raise SwapLayoutError(
            f"host buffer [{plan.host.ptr:#x}, +{used_bytes}) spans several page-locked "
            "registrations; register it as one range"
        )
    return int(first.devicePointer)


def _vector_bytes(plan: SwapPlan, host_address: int) -> int:
    """Widest access dividing the chunk size and every base address (no tail is ever left)."""
    common = math.gcd(plan.geometry.chunk_bytes, plan.host_chunk_bytes, plan.host_offset_bytes)
    for address in [t.ptr for t in plan.cache.tensors] + [host_address]:
        common = math.gcd(common, address)
    return next(v for v in _VEC_TYPES if common % v == 0)


def choose_strategy(plan: SwapPlan, config: CudaLaunchConfig) -> str:
    """ "kernel" or "dma" for this plan (see CudaLaunchConfig.strategy)."""
    if config.strategy != "auto":
        return config.strategy
    long_runs = (
        plan.geometry.chunk_bytes >= config.dma_min_chunk_bytes
        and mean_run_bytes(plan) >= config.dma_min_run_bytes
    )
    return "dma" if long_runs else "kernel"


def swap_on_cuda(
    plan: SwapPlan, stream: object = None, config: CudaLaunchConfig = DEFAULT_LAUNCH
) -> SwapHandle:
    """Queue the plan on `stream` (CuPy's current stream when None); returns at once."""
    assert plan.cache.on_gpu, "swap_on_cuda needs GPU layer tensors"
    if plan.num_items == 0:
        return SwapHandle()
    cupy = import_cupy()
    device_id = device_of_cache(cupy, plan.cache)
    geometry = plan.geometry
    with cupy.cuda.Device(device_id):
        cuda_stream = resolve_stream(cupy, stream)
        host_address = _staging_address(cupy, plan, device_id)
        if choose_strategy(plan, config) == "dma":
            swap_with_dma(cupy, plan, cuda_stream.ptr)
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(cuda_stream)
            return CudaSwapHandle(event, keepalive=())
        vec_bytes = _vector_bytes(plan, host_address)
        chunk_vecs = geometry.chunk_bytes // vec_bytes
        host_chunk_vecs = plan.host_chunk_bytes // vec_bytes
        host_offset_vecs = plan.host_offset_bytes // vec_bytes
        pieces_per_chunk = -(-chunk_vecs // _PIECE_VECS)
        num_units = plan.num_items * geometry.num_tensors * pieces_per_chunk
        warps_per_cta = config.threads_per_cta // 32
        # [num_tensors | num_items | num_items]: layer addresses, block ids, host slots
        addresses = np.array([t.ptr for t in plan.cache.tensors], dtype=np.uint64)
        table_host = np.concatenate([addresses.view(np.int64), plan.block_ids, plan.host_slots])
        with cuda_stream:
            # Allocated under the stream: CuPy's pool reuses it only in that stream's order.
            table = cupy.empty(table_host.shape[0], dtype=np.int64)
            table.data.copy_from_host_async(
                table_host.ctypes.data_as(ctypes.c_void_p), table_host.nbytes
            )
            table_ptr = table.data.ptr
            num_tensors, num_items = geometry.num_tensors, plan.num_items
            max_ctas = config.device_max_ctas if plan.host.on_gpu else config.max_ctas
            kernel = _kernels(device_id)[(vec_bytes, plan.mode)]
            kernel(
                (min(-(-num_units // warps_per_cta), max_ctas),),
                (config.threads_per_cta,),
                (
                    np.uint64(table_ptr),
                    np.uint64(table_ptr + 8 * num_tensors),
                    np.uint64(table_ptr + 8 * (num_tensors + num_items)),
                    np.uint64(host_address),
                    np.int64(num_items),
                    np.int64(num_tensors),
                    np.int64(chunk_vecs),
                    np.int64(host_chunk_vecs),
                    np.int64(host_offset_vecs),
                    np.int64(pieces_per_chunk),
                ),
                stream=cuda_stream,
            )
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(cuda_stream)
    return CudaSwapHandle(event, keepalive=(table, table_host))
