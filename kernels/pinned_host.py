"""Page-locked host memory the swap kernel can read and write directly (GPU hosts only).

Two ways to get there, both released explicitly (or by `with`), never left to a global:
- `PinnedHostBuffer(nbytes)`: new memory from cudaHostAlloc(Portable | Mapped).
- `HostRegistration(ptr, nbytes)`: cudaHostRegister on memory someone else owns, such as the
  buffer Mooncake's `alloc_from_mem_pool` returns; unregistered on close, the memory stays.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernels.cuda_swap import import_cupy
from kernels.tensor_refs import HostBuffer

_HOST_ALLOC_PORTABLE_MAPPED = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped
_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class PinnedHostBuffer:
    """`nbytes` of page-locked host memory mapped into every GPU's address space."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self._runtime = import_cupy().cuda.runtime
        self.nbytes = nbytes
        self.ptr: int = self._runtime.hostAlloc(nbytes, _HOST_ALLOC_PORTABLE_MAPPED)

    @property
    def buffer(self) -> HostBuffer:
        """The address and size, as swap_cache_layout takes them."""
        self._check_open()
        return HostBuffer(self.ptr, self.nbytes)

    def as_array(self) -> np.ndarray:
        """A uint8 numpy view of the memory; valid only until close()."""
        self._check_open()
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))

    def close(self) -> None:
        """Free the memory (synchronous: wait for kernels using it first)."""
        if self.ptr:
            self._runtime.freeHost(self.ptr)
            self.ptr = 0

    def _check_open(self) -> None:
        if not self.ptr:
            raise ValueError("PinnedHostBuffer is closed")

    def __enter__(self) -> PinnedHostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostRegistration:
    """Page-locks and maps an existing host range for the GPU until close()."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        if ptr <= 0 or nbytes <= 0:
            raise ValueError(f"need a non-null address and a positive size, got {ptr}, {nbytes}")
        self._runtime = import_cupy().cuda.runtime
        self._runtime.hostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def buffer(self) -> HostBuffer:
        return HostBuffer(self.ptr, self.nbytes)

    def close(self) -> None:
        """Unregister (the memory itself stays with its owner)."""
        if self.ptr:
            self._runtime.hostUnregister(self.ptr)
            self.ptr = 0

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
