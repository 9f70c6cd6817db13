"""Fresh pools and pool worker processes, and one measured put or get across several of them.

    lab = PoolLab(log_dir, max_workers=8)
    with lab.pool(size_bytes, threads=2, env={"MC_STORE_USE_HUGEPAGE": "1"}) as pool:
        lab.connect(pool, workers=4, value_bytes=2 << 20, num_slots=64)
        lab.op(pool, "put", keys_per_worker, batch=64)   # all 4 at once: aggregate GB/s

Each pool is a new LocalPool (master + `pdworker pool` + its `mooncake_client`), so its
segment starts unwritten; `env` reaches the owner processes only. Around every operation the
owner's `mooncake_client` is sampled from /proc (benchmarks.handoff.procstat).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.handoff import procstat
from benchmarks.handoff.actor import Actor
from benchmarks.handoff.pool_worker import PoolWorker


@dataclass(frozen=True)
class PoolHandle:
    where: dict[str, str]  # what a client needs: master_addr, metadata_url, owner_addr
    owner_pid: int | None  # the mooncake_client that owns the memory
    start_s: float  # master + owner start, until both answer /health


@contextlib.contextmanager
def owner_env(env: dict[str, str] | None) -> Iterator[None]:
    """Set env for the processes started inside (the owner inherits ours), then restore."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class PoolLab:
    def __init__(self, log_dir: Path, max_workers: int) -> None:
        self.log_dir = log_dir
        self.workers = [Actor(f"pool-worker-{i}", PoolWorker) for i in range(max_workers)]
        self._pools = 0

    @contextlib.contextmanager
    def pool(
        self, size_bytes: int, threads: int = 2, env: dict[str, str] | None = None
    ) -> Iterator[PoolHandle]:
        from workers.pool.local_pool import LocalPool

        self._pools += 1
        pool = LocalPool(
            size_bytes, log_dir=self.log_dir / f"pool{self._pools}", owner_threads=threads
        )
        try:
            with owner_env(env):
                t0 = time.perf_counter()
                pool.start(timeout_s=60.0)
                start_s = time.perf_counter() - t0
            a = pool.addresses
            where = {
                "master_addr": a.master_addr,
                "metadata_url": a.metadata_url,
                "owner_addr": a.owner_addr,
            }
            assert pool.owner is not None
            yield PoolHandle(where, procstat.mooncake_client_pid(pool.owner.pid), start_s)
        finally:
            for worker in self.workers:
                worker.settle()
                with contextlib.suppress(RuntimeError):
                    worker.call("disconnect")
            pool.stop()

    def connect(
        self, pool: PoolHandle, workers: int, value_bytes: int, num_slots: int, transport="shm"
    ) -> None:
        for worker in self.workers[:workers]:
            worker.send(
                "connect",
                pool=pool.where,
                num_slots=num_slots,
                slot_bytes=value_bytes,
                transport=transport,
            )
        for worker in self.workers[:workers]:
            worker.result()

    def op(
        self, pool: PoolHandle, op: str, keys_per_worker: list[list[str]], batch: int
    ) -> dict[str, Any]:
        """Workers 0..len(keys_per_worker)-1 each put/get their keys, all starting together."""
        return self.ops(pool, [(op, keys) for keys in keys_per_worker], batch)

    def ops(
        self, pool: PoolHandle, work: list[tuple[str, list[str]]], batch: int
    ) -> dict[str, Any]:
        """Worker i runs work[i] = (op, keys), all at once (puts and gets may mix)."""
        before = procstat.sample(pool.owner_pid) if pool.owner_pid else None
        start_at = time.perf_counter() + 0.2
        for worker, (op, keys) in zip(self.workers, work, strict=False):
            worker.send(op, keys=keys, batch=batch, start_at=start_at)
        spans = [worker.result() for worker in self.workers[: len(work)]]
        after = procstat.sample(pool.owner_pid) if pool.owner_pid else None
        wall = max(s["t1"] for s in spans) - min(s["t0"] for s in spans)
        out: dict[str, Any] = {"wall_s": wall, "each_s": [s["t1"] - s["t0"] for s in spans]}
        owner = procstat.delta(before, after)
        if owner is not None:
            out.update(owner.as_dict())
        return out

    def remove(self, keys_per_worker: list[list[str]]) -> None:
        for worker, keys in zip(self.workers, keys_per_worker, strict=False):
            worker.send("remove", keys=keys)
        for worker, keys in zip(self.workers, keys_per_worker, strict=False):
            removed = worker.result()
            assert removed == len(keys), f"removed {removed} of {len(keys)} keys"

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
