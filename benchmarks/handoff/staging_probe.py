"""Which staging buffer should a GPU worker use, per transport? Run in its own process.

    variant          transport               staging memory                     made page-locked by
    shm-mooncake     setup_dummy (same host) alloc_from_mem_pool (owner's shm)  cudaHostRegister
    shm-pinned       setup_dummy             cudaHostAlloc                      itself
    tcp-pageable     setup (TCP)             our anonymous mmap (StagingBuffer) cudaHostRegister
    tcp-pinned       setup (TCP)             cudaHostAlloc                      itself

Each: register_buffer's answer (Mooncake must accept the memory), the time to page-lock it,
then scattered blocks D2H into it (swap_cache_layout), put, get back into the zeroed buffer
(checked byte for byte against what the D2H wrote), H2D out of it. Raw MooncakeDistributedStore
calls, since KVPoolClient always makes its own buffer. With --cpu: no page-locking, CPU kernel,
and the pinned variants use our own mmap instead (does Mooncake take memory it did not make?).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import numpy as np

from benchmarks.handoff.kv import KvCache, KvShape, scattered_ids
from kernels.swap_cache_layout import swap_cache_layout

VARIANTS = ("shm-mooncake", "shm-pinned", "tcp-pageable", "tcp-pinned")


class StagingProbe:
    def __init__(self, gpu: bool, shape: KvShape, block_size: int, num_blocks: int) -> None:
        if gpu:
            from kernels.cuda_swap import import_cupy

            self.xp: Any = import_cupy()
        else:
            self.xp = np
        self.gpu = gpu
        self.num_blocks = num_blocks
        self.slot_bytes = shape.slot_bytes(block_size)
        self.cache = KvCache(self.xp, shape, 2 * num_blocks + 1, block_size)
        self.cache.fill()
        self.src_ids = scattered_ids(2 * num_blocks + 1, num_blocks, seed=3)
        self.dst_ids = scattered_ids(2 * num_blocks + 1, num_blocks, seed=4)

    def run(self, pool: dict[str, str], variant: str, batch: int, tag: str) -> dict[str, Any]:
        from mooncake.store import MooncakeDistributedStore

        from workers.pool.connect import store_env

        transport, memory = variant.split("-")
        note = ""
        if memory == "pinned" and not self.gpu:
            memory, note = "pageable", "CPU: our own mmap stands in for cudaHostAlloc"
        os.environ.update(store_env(30))
        nbytes = self.num_blocks * self.slot_bytes
        store = MooncakeDistributedStore()
        if transport == "shm":
            rc = store.setup_dummy(nbytes, 0, pool["owner_addr"])
        else:
            rc = store.setup(
                "127.0.0.1", pool["metadata_url"], 0, 0, "tcp", "", pool["master_addr"]
            )
        assert rc == 0, f"{variant}: setup returned {rc}"
        keep: list[Any] = []  # what must outlive the store's use of the buffer
        try:
            if memory == "mooncake":
                ptr = store.alloc_from_mem_pool(nbytes)
                assert ptr, "alloc_from_mem_pool refused"
            elif memory == "pageable":
                from workers.pool.staging import StagingBuffer

                keep.append(StagingBuffer(self.num_blocks, self.slot_bytes))
                ptr = keep[-1].ptr
            else:
                from kernels.pinned_host import PinnedHostBuffer

                keep.append(PinnedHostBuffer(nbytes))
                ptr = keep[-1].ptr
            out: dict[str, Any] = {"register_buffer_rc": store.register_buffer(ptr, nbytes)}
            if out["register_buffer_rc"] != 0:
                out["note"] = f"{note} Mooncake refused the buffer".strip()
                return out
            if note:
                out["note"] = note
            try:
                out.update(self._measure(store, ptr, nbytes, memory, batch, tag))
            finally:
                store.unregister_buffer(ptr)
            return out
        finally:
            store.close()
            for item in reversed(keep):
                if hasattr(item, "close"):
                    item.close()

    def _measure(
        self, store: Any, ptr: int, nbytes: int, memory: str, batch: int, tag: str
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        registration = None
        if self.gpu and memory != "pinned":
            from kernels.pinned_host import HostRegistration

            t0 = time.perf_counter()
            registration = HostRegistration(ptr, nbytes)
            out["page_lock_s"] = time.perf_counter() - t0
        try:
            view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
            view = view.reshape(self.num_blocks, self.slot_bytes)
            slots = list(range(self.num_blocks))
            tensors = self.cache.tensors
            t0 = time.perf_counter()
            swap_cache_layout(tensors, view, self.src_ids, slots, 0).wait()
            out["d2h_s"] = time.perf_counter() - t0
            sent = view.copy()
            ptrs = [ptr + s * self.slot_bytes for s in slots]
            keys = [f"{tag}/{s}" for s in slots]
            sizes = [self.slot_bytes] * len(slots)
            out["put_s"] = _batched(store.batch_put_from, keys, ptrs, sizes, batch, expect=0)
            view[:] = 0
            out["get_s"] = _batched(store.batch_get_into, keys, ptrs, sizes, batch, expect=None)
            out["exact"] = bool(np.array_equal(view, sent))
            t0 = time.perf_counter()
            swap_cache_layout(tensors, view, self.dst_ids, slots, 1).wait()
            out["h2d_s"] = time.perf_counter() - t0
            store.batch_remove(keys, True)
            del view
        finally:
            if registration is not None:
                registration.close()
        out["bytes"] = nbytes
        return out


def _batched(call: Any, keys: list, ptrs: list, sizes: list, batch: int, expect: Any) -> float:
    """Seconds for call over every key, batch keys a call; each key must answer expect
    (put: 0) or its size (get)."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        part = slice(i, i + batch)
        codes = call(keys[part], ptrs[part], sizes[part])
        wanted = sizes[part] if expect is None else [expect] * len(codes)
        assert list(codes) == list(wanted), f"codes {sorted(set(codes))}"
    return time.perf_counter() - t0
