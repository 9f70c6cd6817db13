"""One client shared by concurrent requests: slots, results and counters stay exact."""

from __future__ import annotations

import threading

import pytest

from tests.workers.pool.actor import digest, pattern
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import LeaseHeldError

SLOT_BYTES = 64 << 10


def _client(addr, transport: str, num_slots: int) -> KVPoolClient:
    return KVPoolClient(
        PoolClientConfig(
            master_addr=addr.master_addr,
            metadata_url=addr.metadata_url,
            num_slots=num_slots,
            slot_bytes=SLOT_BYTES,
            owner_addr=addr.owner_addr if transport == "shm" else None,
        )
    ).connect()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_concurrent_requests_share_one_buffer(running_pool, transport):
    num_requests, blocks_each = 4, 8
    client = _client(running_pool, transport, num_requests * blocks_each)
    failures: list[str] = []
    barrier = threading.Barrier(num_requests)

    def request(req: int) -> None:
        slots = client.slots.allocate(blocks_each)
        assert slots is not None
        keys = [f"shared/{transport}/{req}/{i}" for i in range(blocks_each)]
        for i, slot in enumerate(slots):
            client.buffer.slot(slot)[:] = pattern(req, i, SLOT_BYTES)
        barrier.wait()  # every request puts at once
        if not client.put_from(keys, slots).ok:
            failures.append(f"put {req}")
        client.buffer.view[slots] = 0
        got = client.get_into(keys, slots)
        if got.codes != (SLOT_BYTES,) * blocks_each:
            failures.append(f"get {req}: {got.codes}")
        for i, slot in enumerate(slots):
            if digest(client.buffer.slot(slot)) != digest(pattern(req, i, SLOT_BYTES)):
                failures.append(f"bytes {req}/{i}")
        client.slots.free(slots)

    threads = [threading.Thread(target=request, args=(r,)) for r in range(num_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert failures == []
        assert client.slots.num_free == num_requests * blocks_each
        assert client.slots.allocate(num_requests * blocks_each + 1) is None
        client.slots.check_integrity()
        stats = client.stats()
        total = num_requests * blocks_each
        assert (stats.keys_put, stats.hits, stats.misses) == (total, total, 0)
        assert (stats.bytes_put, stats.bytes_got) == (total * SLOT_BYTES, total * SLOT_BYTES)
        assert (stats.errors, stats.timeouts) == ({}, 0)
    finally:
        client.close()


def test_remove_of_a_key_just_read_reports_the_lease(running_pool):
    client = _client(running_pool, "tcp", 1)
    try:
        slots = client.slots.allocate(1)
        assert client.put_from(["lease/0"], slots).ok
        assert client.get_into(["lease/0"], slots).ok  # takes a 5 s read lease
        result = client.remove(["lease/0"])  # retried for retry_budget_s (1 s), then reported
        assert result.codes == (-706,)
        with pytest.raises(LeaseHeldError, match="1/1 keys lease_held"):
            result.raise_for_error()
        assert client.exists(["lease/0"]) == [True]
    finally:
        client.close()
