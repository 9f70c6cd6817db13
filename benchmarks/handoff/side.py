"""One side of the handoff in its own process: P (writes its cache to the pool) or D (reads it).

Each side holds a KvCache (CuPy on the GPU, numpy with --cpu), a KVPoolClient over shared
memory (the same client and the same setup the workers use) and, on the GPU, the client's
staging buffer page-locked with cudaHostRegister (kernels.pinned_host.HostRegistration), since
swap_cache_layout refuses pageable host memory. Path "device": the handoff goes through a
DevicePool over that client (workers/pool/handoff_path.py, --handoff-path device), as a GPU
worker's does. `checked`: the same pool behind workers.pool.checked_pool.CheckedPool (every
object with its header, every read checked), what a worker runs with --pool-integrity on;
write and read take integrity=True to go through it. Driven by benchmarks.handoff.actor.Actor.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.handoff import procstat
from benchmarks.handoff.kv import KvCache, KvShape
from benchmarks.handoff.paths import MODES


class Side:
    """P or D: cache, pool client, staging registration, and the timed half of a handoff."""

    def __init__(
        self, role: str, gpu: bool, shape: KvShape, path: str = "host", device_calls: int = 4
    ) -> None:
        assert role in ("prefill", "decode"), role
        assert path in ("host", "device"), path
        self.role, self.gpu, self.shape, self.path = role, gpu, shape, path
        self.device_calls = device_calls
        if gpu:
            from kernels.cuda_swap import import_cupy

            self.xp = import_cupy()
        else:
            import numpy

            self.xp = numpy
        self.cache: KvCache | None = None
        self.pool: Any = None  # what the handoff takes: the client, or a DevicePool over it
        self.client: Any = None
        self.checked: Any = None  # CheckedPool over pool
        self.registration: Any = None
        self.owner_pid: int | None = None
        self.bulk: Any = None

    # ---- setup ---------------------------------------------------------------------------

    def alloc(self, num_blocks: int, block_size: int) -> dict[str, float]:
        """A fresh cache (P's filled with the pattern, D's zeroed); the old one is freed."""
        self.cache = None
        if self.gpu:
            self.xp.get_default_memory_pool().free_all_blocks()
        t0 = time.perf_counter()
        self.cache = KvCache(self.xp, self.shape, num_blocks, block_size)
        if self.role == "prefill":
            self.cache.fill()
        self._sync()
        return {"alloc_s": time.perf_counter() - t0, "cache_bytes": self.cache.nbytes()}

    def connect(
        self, pool: dict[str, str], num_slots: int, slot_bytes: int, checked: dict | None = None
    ) -> dict[str, float]:
        """A KVPoolClient on the pool's shared memory; on the GPU its staging is registered.
        checked: keyword arguments of the CheckedPool beside it (integrity passes)."""
        from workers.pool.client import KVPoolClient, PoolClientConfig

        config = PoolClientConfig(
            master_addr=pool["master_addr"],
            metadata_url=pool["metadata_url"],
            owner_addr=pool["owner_addr"],
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            call_timeout_s=120.0,
            cuda_device=0 if self.gpu else None,
        )
        t0 = time.perf_counter()
        self.pool = self.client = KVPoolClient(config).connect()
        t1 = time.perf_counter()
        register_s = 0.0
        if self.gpu:
            from kernels.pinned_host import HostRegistration

            buffer = self.client.buffer
            self.registration = HostRegistration(buffer.ptr, buffer.nbytes)
            register_s = time.perf_counter() - t1
        if self.path == "device":
            from workers.pool.handoff_path import choose_handoff_path

            device_id = 0 if self.gpu else None
            calls = self.device_calls
            self.pool = choose_handoff_path(
                "device", self.client, device_id, device_calls=calls
            ).pool
        from workers.pool.checked_pool import CheckedPool

        assert self.cache is not None
        self.checked = CheckedPool(self.pool, self.cache.tensor_shape[2], **(checked or {}))
        self.owner_pid = procstat.mooncake_client_pid(int(pool["owner_pid"]))
        self._warm_kernel()
        return {"connect_s": t1 - t0, "register_s": register_s}

    def _warm_kernel(self) -> None:
        """Compile the copy kernel (NVRTC, first use) outside any timed stage: one block
        through slot 0, out of P's cache or into D's (whose blocks are reset before a pass)."""
        from kernels.swap_cache_layout import swap_cache_layout

        assert self.cache is not None and self.pool is not None
        mode = 0 if self.role == "prefill" else 1
        slots = self.pool.slots.allocate(1)
        try:
            swap_cache_layout(self.cache.tensors, self.pool.buffer.view, [0], slots, mode).wait()
            staging = self.pool.buffer  # the checksum's kernel too (GPU: compiled at first use)
            staging.checksums(slots, staging.checksum_kind)
        finally:
            self.pool.slots.free(slots)

    def disconnect(self) -> None:
        if self.registration is not None:
            self._sync()
            self.registration.close()
            self.registration = None
        if self.pool is not None:
            self.pool.close()  # a DevicePool closes its client too
            self.pool = self.client = self.checked = None

    def close(self) -> None:
        self.disconnect()
        if self.bulk is not None:
            self.bulk.close()

    # ---- one handoff ---------------------------------------------------------------------

    def reset(self, block_ids: list[int]) -> None:
        """D: zero the blocks a pass will fill, so a pass that moved nothing cannot pass."""
        assert self.cache is not None
        self.cache.zero_blocks(block_ids)
        self._sync()

    def write(
        self, mode: str, keys: list[str], block_ids: list[int], group: int, integrity: bool = False
    ) -> dict:
        assert self.role == "prefill" and self.cache is not None
        pool = self.checked if integrity else self.pool
        before = procstat.sample(self.owner_pid) if self.owner_pid else None
        times = MODES[mode].write(pool, self.cache.tensors, block_ids, keys, group)
        after = procstat.sample(self.owner_pid) if self.owner_pid else None
        owner = procstat.delta(before, after)
        return {
            "d2h_s": times.d2h_s,
            "put_s": times.put_s,
            "write_wall_s": times.wall_s,
            **({f"put_{k}": v for k, v in owner.as_dict().items()} if owner else {}),
        }

    def read(
        self,
        mode: str,
        keys: list[str],
        block_ids: list[int],
        source_ids: list[int],
        group: int,
        integrity: bool = False,
    ) -> dict:
        """D's half, then the byte-exact check against P's pattern (untimed)."""
        assert self.role == "decode" and self.cache is not None
        pool = self.checked if integrity else self.pool
        before = procstat.sample(self.owner_pid) if self.owner_pid else None
        times = MODES[mode].read(pool, self.cache.tensors, block_ids, keys, group)
        after = procstat.sample(self.owner_pid) if self.owner_pid else None
        owner = procstat.delta(before, after)
        return {
            "get_s": times.get_s,
            "h2d_s": times.h2d_s,
            "read_wall_s": times.wall_s,
            "exact": self.cache.holds(block_ids, source_ids),
            **({f"get_{k}": v for k, v in owner.as_dict().items()} if owner else {}),
        }

    def remove(self, keys: list[str], integrity: bool = False) -> int:
        """Free the pass's objects (untimed) so the next pass reuses the owner's memory.

        Forced: the get just made holds a read lease on every key for the master's lease time
        (5 s), which an unforced remove rightly respects.
        """
        pool = self.checked if integrity else self.client  # checked: headers too
        return len(pool.remove(list(keys), force=True).ok_keys)

    # ---- limits of this host -------------------------------------------------------------

    def bulk_copy(self, nbytes: int, reps: int, capacity: int) -> dict[str, float]:
        """GB/s of one pinned cudaMemcpyAsync of nbytes each way (median of reps); buffers of
        capacity bytes are made at the first call and reused."""
        from benchmarks.handoff.limits import BulkCopy

        if not self.gpu:
            return {}
        if self.bulk is None:
            self.bulk = BulkCopy(self.xp, max(capacity, nbytes))
        return self.bulk.gbps(nbytes, reps)

    def _sync(self) -> None:
        if self.gpu:
            self.xp.cuda.runtime.deviceSynchronize()
