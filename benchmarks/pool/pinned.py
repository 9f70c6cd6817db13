"""Can a shared-memory staging buffer be page-locked for a GPU, and how fast does it copy?

    python3 benchmarks/pool/pinned.py        (on a host with an NVIDIA driver; stdlib only)

Over the same-host shared-memory path the staging buffer is a MAP_SHARED mapping (Mooncake
hands it between client and owner as a file descriptor), not private anonymous memory. The
swap_cache_layout kernel needs the buffer page-locked and mapped for the device. This maps
1 GiB three ways (private anonymous, memfd shared, /dev/shm shared), registers each with
cuMemHostRegister (through the driver API, so no CUDA toolkit or Python package is needed)
and times 1 GiB host<->device copies, pageable and registered.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

NUM_BYTES = 1 << 30
CU_MEMHOSTREGISTER_DEVICEMAP = 2


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cuda.cuMemHostGetDevicePointer_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_void_p,
        ctypes.c_uint,
    ]
    return cuda


def _check(cuda: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA error {rc} {name.value!r}")


def _region(kind: str) -> mmap.mmap:
    if kind == "anon-private":
        return mmap.mmap(-1, NUM_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "memfd-shared":
        fd = os.memfd_create("pdpool-staging")
    else:
        path = f"/dev/shm/pdpool-probe-{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.unlink(path)
    os.ftruncate(fd, NUM_BYTES)
    return mmap.mmap(fd, NUM_BYTES, flags=mmap.MAP_SHARED)


def _gbps(cuda: ctypes.CDLL, host_ptr: int, dev_ptr: int) -> tuple[float, float]:
    results = []
    for copy in (
        lambda: cuda.cuMemcpyHtoD_v2(dev_ptr, host_ptr, NUM_BYTES),
        lambda: cuda.cuMemcpyDtoH_v2(host_ptr, dev_ptr, NUM_BYTES),
    ):
        _check(cuda, copy(), "copy")  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            _check(cuda, copy(), "copy")
        results.append(3 * NUM_BYTES / (time.perf_counter() - start) / 1e9)
    return results[0], results[1]


def main() -> int:
    cuda = _driver()
    _check(cuda, cuda.cuInit(0), "cuInit")
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda, cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    _check(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "context")
    _check(cuda, cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    dev_ptr = ctypes.c_uint64()
    _check(cuda, cuda.cuMemAlloc_v2(ctypes.byref(dev_ptr), ctypes.c_size_t(NUM_BYTES)), "alloc")
    for kind in ("anon-private", "memfd-shared", "shm_open-shared"):
        region = _region(kind)
        for offset in range(0, NUM_BYTES, mmap.PAGESIZE):  # fault every page in
            region[offset] = 1
        view = (ctypes.c_char * NUM_BYTES).from_buffer(region)
        host_ptr = ctypes.addressof(view)
        h2d, d2h = _gbps(cuda, host_ptr, dev_ptr.value)
        print(f"{kind:16} pageable              h2d {h2d:5.1f}  d2h {d2h:5.1f} GB/s")
        rc = cuda.cuMemHostRegister_v2(host_ptr, NUM_BYTES, CU_MEMHOSTREGISTER_DEVICEMAP)
        if rc:
            print(f"{kind:16} cuMemHostRegister failed: {rc}")
        else:
            mapped = ctypes.c_uint64()
            rc = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(mapped), host_ptr, 0)
            h2d, d2h = _gbps(cuda, host_ptr, dev_ptr.value)
            same = "same address" if rc == 0 and mapped.value == host_ptr else f"rc {rc}"
            print(f"{kind:16} registered (devicemap) h2d {h2d:5.1f}  d2h {d2h:5.1f} GB/s, {same}")
            _check(cuda, cuda.cuMemHostUnregister(host_ptr), "unregister")
        del view
        region.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
