"""Uniform views of the arrays swap_cache_layout accepts, without importing any framework.

The kernel only needs addresses, shapes and element sizes, so every input is reduced to a
`TensorRef` by duck typing: numpy arrays, Paddle CPU tensors (through dlpack, no copy) and
PyTorch CPU tensors (`.numpy()` of a same-width integer view, no copy) on the CPU; anything
exposing `__cuda_array_interface__` (CuPy, PyTorch) and Paddle GPU tensors (`data_ptr()`) on
the GPU. Nothing here imports Paddle or CuPy, so a machine with neither can
still validate and run the CPU path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.layout import SUPPORTED_ELEM_BYTES, CacheGeometry, SwapLayoutError

# Paddle's dlpack export refuses bfloat16 and float8, so CPU tensors are first viewed as a
# same-width integer dtype (a reinterpretation, not a copy).
# PyTorch's .numpy() refuses bfloat16 likewise: the same integer views.
_PADDLE_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32"}


@dataclass(frozen=True)
class HostBuffer:
    """A raw host buffer (e.g. from Mooncake's `alloc_from_mem_pool`): address and size."""

    ptr: int
    nbytes: int


@dataclass(frozen=True)
class DeviceBuffer:
    """Staging in GPU memory (cudaMalloc'd: workers/pool/device_staging.py), laid out in slots
    exactly as a host buffer is; only GPU layer tensors on the same device copy to or from it."""

    ptr: int
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
    """One C-contiguous array reduced to what the copy needs."""

    ptr: int
    shape: tuple[int, ...]
    elem_bytes: int
    on_gpu: bool
    # Flat uint8 view of the same memory for CPU arrays (None on the GPU).
    host_bytes: np.ndarray | None


@dataclass(frozen=True)
class CacheRef:
    """The validated worker cache: geometry plus one TensorRef per layer tensor."""

    geometry: CacheGeometry
    tensors: tuple[TensorRef, ...]
    on_gpu: bool


@dataclass(frozen=True)
class HostRef:
    """The validated host buffer."""

    ptr: int
    nbytes: int
    writable: bool
    # Flat uint8 view when given as a numpy array (None for a raw HostBuffer).
    host_bytes: np.ndarray | None
    on_gpu: bool = False  # a DeviceBuffer: the "host" side of the layout lives in GPU memory


def _numpy_ref(array: np.ndarray, name: str) -> TensorRef:
    if not array.flags.c_contiguous:
        raise SwapLayoutError(f"{name} must be C-contiguous (strides {array.strides})")
    flat = array.reshape(-1).view(np.uint8)
    return TensorRef(array.ctypes.data, tuple(array.shape), array.itemsize, False, flat)


def _cuda_interface_ref(obj: Any, name: str) -> TensorRef:
    iface = obj.__cuda_array_interface__
    shape = tuple(int(d) for d in iface["shape"])
    elem_bytes = np.dtype(iface["typestr"]).itemsize
    strides = iface.get("strides")
    if strides is not None:
        expected, step = [], elem_bytes
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if tuple(strides) != tuple(reversed(expected)):
            raise SwapLayoutError(f"{name} must be C-contiguous (strides {tuple(strides)})")
    return TensorRef(int(iface["data"][0]), shape, elem_bytes, True, None)


def _paddle_ref(tensor: Any, name: str) -> TensorRef:
    place = tensor.place
    if not tensor.is_contiguous():
        raise SwapLayoutError(f"{name} must be contiguous (Paddle strides {tensor.strides})")
    shape = tuple(int(d) for d in tensor.shape)
    elem_bytes = int(tensor.element_size())
    if place.is_gpu_place():
        return TensorRef(int(tensor.data_ptr()), shape, elem_bytes, True, None)
    if not place.is_cpu_place():
        raise SwapLayoutError(
            f"{name} lives on {place}; only CPU and CUDA GPU tensors are supported"
        )
    if elem_bytes not in _PADDLE_INT_VIEW:
        raise SwapLayoutError(
            f"{name} has {elem_bytes}-byte elements; supported sizes are {SUPPORTED_ELEM_BYTES}"
        )
    array = np.from_dlpack(tensor.view(_PADDLE_INT_VIEW[elem_bytes]))
    return _numpy_ref(array.reshape(shape), name)


def _torch_cpu_ref(tensor: Any, name: str) -> TensorRef:
    import torch  # already imported: `tensor` is one of its tensors

    if tensor.device.type != "cpu":
        raise SwapLayoutError(
            f"{name} lives on {tensor.device}; only CPU and CUDA GPU tensors are supported"
        )
    if not tensor.is_contiguous():
        raise SwapLayoutError(f"{name} must be contiguous (torch strides {tensor.stride()})")
    elem_bytes = tensor.element_size()
    if elem_bytes not in _PADDLE_INT_VIEW:
        raise SwapLayoutError(
            f"{name} has {elem_bytes}-byte elements; supported sizes are {SUPPORTED_ELEM_BYTES}"
        )
    array = tensor.detach().view(getattr(torch, _PADDLE_INT_VIEW[elem_bytes])).numpy()
    return _numpy_ref(array, name)


def _gpu_ref(ptr: int, shape: tuple, elem_bytes: int, contiguous: bool, name: str) -> TensorRef:
    if not contiguous:
        raise SwapLayoutError(f"{name} must be C-contiguous")
    return TensorRef(int(ptr), tuple(int(d) for d in shape), int(elem_bytes), True, None)


def describe_tensor(obj: object, name: str = "tensor") -> TensorRef:
    """Reduce a numpy array, Paddle tensor or CUDA-array-interface object to a TensorRef."""
    if isinstance(obj, np.ndarray):
        return _numpy_ref(obj, name)
    # CuPy and PyTorch build `__cuda_array_interface__` as a fresh dict on every access (~10 us),
    # which a 160-tensor cache would pay on every call: read their attributes directly.
    package = type(obj).__module__.split(".")[0]
    gpu: Any = obj
    if package == "cupy" and hasattr(gpu, "data") and hasattr(gpu, "flags"):
        return _gpu_ref(gpu.data.ptr, gpu.shape, gpu.itemsize, gpu.flags.c_contiguous, name)
    if package == "torch" and getattr(gpu, "is_cuda", False):
        return _gpu_ref(gpu.data_ptr(), gpu.shape, gpu.element_size(), gpu.is_contiguous(), name)
    if package == "torch" and hasattr(gpu, "untyped_storage"):
        return _torch_cpu_ref(gpu, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cuda_interface_ref(obj, name)
    if package == "paddle" and hasattr(obj, "place"):
        return _paddle_ref(obj, name)
    if hasattr(obj, "__dlpack__"):
        try:
            return _numpy_ref(np.from_dlpack(obj), name)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise SwapLayoutError(f"{name} could not be viewed through dlpack: {exc}") from exc
    raise SwapLayoutError(
        f"{name} is a {type(obj).__qualname__}; expected a numpy array, a Paddle tensor or a "
        "CUDA array (CuPy, PyTorch)"
    )


def describe_cache(layer_tensors: Sequence[object]) -> CacheRef:
    """Validate [K0, V0, K1, V1, ...]: even count, 4-D, one shape, one element size, one device."""
    if isinstance(layer_tensors, np.ndarray) or not isinstance(layer_tensors, Sequence):
        raise SwapLayoutError("layer_tensors must be a list [K0, V0, K1, V1, ...] of tensors")
    if len(layer_tensors) == 0 or len(layer_tensors) % 2:
        raise SwapLayoutError(
            f"layer_tensors must hold K and V of each layer (an even, non-zero count), "
            f"got {len(layer_tensors)}"
        )
    refs = tuple(describe_tensor(t, f"layer_tensors[{i}]") for i, t in enumerate(layer_tensors))
    first = refs[0]
    if len(first.shape) != 4 or min(first.shape) <= 0:
        raise SwapLayoutError(
            "layer_tensors[0] must be [num_blocks, num_kv_heads, block_size, head_dim] with "
            f"positive sizes, got shape {first.shape}"
        )
    if first.elem_bytes not in SUPPORTED_ELEM_BYTES:
        raise SwapLayoutError(
            f"layer_tensors[0] has {first.elem_bytes}-byte elements; supported sizes are "
            f"{SUPPORTED_ELEM_BYTES}"
        )
    for i, ref in enumerate(refs[1:], start=1):
        if ref.shape != first.shape:
            raise SwapLayoutError(
                f"layer_tensors[{i}] has shape {ref.shape}, layer_tensors[0] has {first.shape}"
            )
        if ref.elem_bytes != first.elem_bytes:
            raise SwapLayoutError(
                f"layer_tensors[{i}] has {ref.elem_bytes}-byte elements, layer_tensors[0] has "
                f"{first.elem_bytes}"
            )
        if ref.on_gpu != first.on_gpu:
            raise SwapLayoutError(
                f"layer_tensors[{i}] is on the {'GPU' if ref.on_gpu else 'CPU'}, "
                f"layer_tensors[0] is not: all layer tensors must live on one device"
            )
    for i, ref in enumerate(refs):
        if ref.ptr % first.elem_bytes:
            raise SwapLayoutError(
                f"layer_tensors[{i}] address {ref.ptr:#x} is not aligned to its "
                f"{first.elem_bytes}-byte elements"
            )
    num_blocks, num_kv_heads, block_size, head_dim = first.shape
    geometry = CacheGeometry(
        len(refs) // 2, num_blocks, num_kv_heads, block_size, head_dim, first.elem_bytes
    )
    return CacheRef(geometry, refs, first.on_gpu)


def describe_host(host: object) -> HostRef:
    """Validate the staging buffer: a C-contiguous numpy array, a HostBuffer(ptr, nbytes) or
    a DeviceBuffer(ptr, nbytes)."""
    if isinstance(host, DeviceBuffer):
        if host.ptr <= 0 or host.nbytes <= 0:
            raise SwapLayoutError(f"device buffer {host} needs a non-null address and a size > 0")
        return HostRef(host.ptr, host.nbytes, True, None, on_gpu=True)
    if isinstance(host, HostBuffer):
        if host.ptr <= 0 or host.nbytes <= 0:
            raise SwapLayoutError(f"host buffer {host} needs a non-null address and a size > 0")
        return HostRef(host.ptr, host.nbytes, True, None)
    if isinstance(host, np.ndarray):
        if not host.flags.c_contiguous:
            raise SwapLayoutError(f"host buffer must be C-contiguous (strides {host.strides})")
        if host.nbytes == 0:
            raise SwapLayoutError("host buffer is empty")
        flat = host.reshape(-1).view(np.uint8)
        return HostRef(host.ctypes.data, host.nbytes, bool(host.flags.writeable), flat)
    raise SwapLayoutError(
        f"host buffer is a {type(host).__qualname__}; expected a numpy array, "
        "HostBuffer(ptr, nbytes) in host memory or DeviceBuffer(ptr, nbytes)"
    )


def bytes_per_slot(layer_tensors: Sequence[object]) -> int:
    """Host slot size for a cache given as [K0, V0, K1, V1, ...] (numpy, Paddle, CuPy or
    PyTorch)."""
    return describe_cache(layer_tensors).geometry.slot_bytes
