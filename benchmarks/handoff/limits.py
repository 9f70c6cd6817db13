"""The same run's ceilings for each handoff stage, measured on the bytes the stage moves.

    bulk copy    one cudaMemcpyAsync between a device buffer and cudaHostAlloc'd (pinned)
                 memory, each way: what D2H and H2D could reach (PCIe)
    host memcpy  one numpy copy between two host buffers already faulted in: what a put or a
                 get (a copy between staging and the pool owner's memory) could reach on one
                 thread

Buffers are allocated once at the largest size and reused (their first touch is not what is
measured); each figure is the median of `reps` timed copies after one untimed copy.
"""

from __future__ import annotations

import statistics
import time
from types import ModuleType

import numpy as np

_MEMCPY_HOST_TO_DEVICE, _MEMCPY_DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind


def _median_s(fn: object, reps: int) -> float:
    fn()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class BulkCopy:
    """A device buffer and a pinned host buffer of capacity bytes, for bulk copies each way."""

    def __init__(self, cupy: ModuleType, capacity: int) -> None:
        from kernels.pinned_host import PinnedHostBuffer

        self.cp = cupy
        self.capacity = capacity
        self.device = cupy.empty(capacity, dtype=cupy.uint8)
        self.host = PinnedHostBuffer(capacity)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def gbps(self, nbytes: int, reps: int) -> dict[str, float]:
        assert nbytes <= self.capacity, (nbytes, self.capacity)
        runtime = self.cp.cuda.runtime
        out = {}
        for name, dst, src, kind in (
            ("d2h", self.host.ptr, self.device.data.ptr, _MEMCPY_DEVICE_TO_HOST),
            ("h2d", self.device.data.ptr, self.host.ptr, _MEMCPY_HOST_TO_DEVICE),
        ):

            def copy(dst: int = dst, src: int = src, kind: int = kind) -> None:
                runtime.memcpyAsync(dst, src, nbytes, kind, self.stream.ptr)
                self.stream.synchronize()

            out[f"bulk_{name}_gbps"] = nbytes / _median_s(copy, reps) / 1e9
        return out

    def close(self) -> None:
        self.host.close()
        self.device = None


class HostMemcpy:
    """Two faulted-in host buffers of capacity bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.src = np.ones(capacity, dtype=np.uint8)
        self.dst = np.zeros(capacity, dtype=np.uint8)
        self.dst[:] = 2  # fault every page of both in before anything is timed

    def gbps(self, nbytes: int, reps: int) -> float:
        assert nbytes <= self.capacity, (nbytes, self.capacity)

        def copy() -> None:
            np.copyto(self.dst[:nbytes], self.src[:nbytes])

        return nbytes / _median_s(copy, reps) / 1e9
