"""Page-locking the pool client's staging buffer for a GPU engine.

    connect():  Mooncake buffer (shm pool or numpy for TCP) ─► cudaHostRegister (once)
    close():    pool calls done ─► cudaHostUnregister ─► Mooncake releases the buffer

swap_cache_layout refuses pageable host memory for GPU tensors ("not page-locked host
memory", kernels/cuda_swap.py): every handoff of a GPU worker would fail at its first copy.
Registering Mooncake's own buffer (rather than handing Mooncake a cudaHostAlloc'ed one) works
for both transports: Mooncake refused a foreign buffer over shared memory (its shm pool hands
out the memory), and measured on an H100 registering 0.5 GiB takes ~0.02 s, after which the
copy kernel reaches 44-48 GB/s each way through it (docs/benchmarks/handoff_probes.md).

A worker whose staging cannot be page-locked refuses to start (PoolSetupError says why)
rather than failing every request later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from workers.pool.errors import PoolSetupError


class PageLock(Protocol):
    """A registration that close() undoes (kernels.pinned_host.HostRegistration)."""

    def close(self) -> None: ...


# (ptr, nbytes) -> a live registration; raises when the range cannot be page-locked.
Register = Callable[[int, int], PageLock]


def cuda_register(ptr: int, nbytes: int) -> PageLock:
    """cudaHostRegister(Portable | Mapped) through CuPy (kernels.pinned_host)."""
    from kernels.pinned_host import HostRegistration

    return HostRegistration(ptr, nbytes)


def lock_staging(ptr: int, nbytes: int, register: Register = cuda_register) -> PageLock:
    """Page-lock [ptr, ptr + nbytes) for the GPU, or raise PoolSetupError naming the cause."""
    try:
        return register(ptr, nbytes)
    except ImportError as exc:
        raise PoolSetupError(
            f"the KV cache is on a GPU, so the {nbytes}-byte pool staging buffer must be "
            f"page-locked for the copy kernel, but CuPy is not importable ({exc}): pip install "
            "cupy-cuda12x (CUDA 12) or cupy-cuda13x (CUDA 13)"
        ) from exc
    except Exception as exc:  # CUDARuntimeError and friends: the driver said no
        raise PoolSetupError(
            f"the KV cache is on a GPU, but cudaHostRegister refused the {nbytes}-byte pool "
            f"staging buffer at {ptr:#x} ({type(exc).__name__}: {exc}); without page-locked "
            "staging the copy kernel cannot reach it. Check the locked-memory limit "
            "(ulimit -l) and free host memory, or lower --staging-slots"
        ) from exc
