"""A pool writer or reader in its own process, for the put probes (no GPU, no cache).

It holds one KVPoolClient (shared memory or TCP) whose staging is filled once with bytes, and
puts or gets lists of keys in batches of `batch`, every batch through the same first slots
(the copy rate does not depend on which slots). Several workers started with one `start_at`
(a time.perf_counter() value: CLOCK_MONOTONIC, the same clock in every process) run
concurrently; each answers when its first batch began and its last one ended.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class PoolWorker:
    def __init__(self) -> None:
        self.client: Any = None
        self.slots: list[int] = []

    def connect(self, pool: dict[str, str], num_slots: int, slot_bytes: int, transport: str) -> Any:
        from workers.pool.client import KVPoolClient, PoolClientConfig

        self.disconnect()
        config = PoolClientConfig(
            master_addr=pool["master_addr"],
            metadata_url=pool["metadata_url"],
            owner_addr=pool["owner_addr"] if transport == "shm" else None,
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            call_timeout_s=120.0,
        )
        t0 = time.perf_counter()
        self.client = KVPoolClient(config).connect()
        connect_s = time.perf_counter() - t0
        self.slots = self.client.slots.allocate(num_slots)
        view = self.client.buffer.view  # [num_slots, slot_bytes]: fault it in, untimed
        view[:] = (np.arange(slot_bytes, dtype=np.uint32) % 251).astype(np.uint8)
        return {"connect_s": connect_s}

    def _run(self, op: str, keys: list[str], batch: int, start_at: float) -> dict[str, float]:
        assert batch <= len(self.slots), f"batch {batch} > {len(self.slots)} slots"
        call = self.client.put_from if op == "put" else self.client.get_into
        time.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter()
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            call(chunk, self.slots[: len(chunk)]).raise_for_error()
        return {"t0": t0, "t1": time.perf_counter()}

    def put(self, keys: list[str], batch: int, start_at: float = 0.0) -> dict[str, float]:
        return self._run("put", keys, batch, start_at)

    def get(self, keys: list[str], batch: int, start_at: float = 0.0) -> dict[str, float]:
        return self._run("get", keys, batch, start_at)

    def remove(self, keys: list[str]) -> int:
        """Forced (readers' leases would hold the keys for 5 s); untimed."""
        codes = self.client._store.batch_remove(list(keys), True)
        return sum(1 for c in codes if c == 0)

    def disconnect(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> None:
        self.disconnect()
