"""The staging warm-up at connect (workers/pool/warm_staging.py), on a real master and owner:
every slot put once and removed, nothing left in the pool, skipped where it cannot run."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.workers.pool.fixtures import start_pool
from workers.pool import client_heal as client_module
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.warm_staging import WARM_KEY_PREFIX, warm_staging

SLOT_BYTES = 256 << 10
NUM_SLOTS = 20  # batches of 8: 8, 8, 4


def config(addr, shm: bool = True, slot_bytes: int = SLOT_BYTES, **kw) -> PoolClientConfig:
    return PoolClientConfig(master_addr=addr.master_addr, metadata_url=addr.metadata_url,
                            owner_addr=addr.owner_addr if shm else None, num_slots=NUM_SLOTS,
                            slot_bytes=slot_bytes, **kw)  # fmt: skip


def pool_keys(addr) -> list[str]:
    text = httpx.get(f"{addr.admin_url}/get_all_keys", timeout=10).text
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_every_slot_is_put_once_and_nothing_stays(running_pool) -> None:
    before = pool_keys(running_pool)
    with KVPoolClient(config(running_pool, warm_staging=False)) as client:
        puts: list[list[int]] = []
        put_from = client.put_from
        client.put_from = lambda keys, slots: puts.append(list(slots)) or put_from(keys, slots)
        assert warm_staging(client, batch_slots=8) is True
        assert sorted(s for batch in puts for s in batch) == list(range(NUM_SLOTS))
        assert [len(b) for b in puts] == [8, 8, 4]
        assert client.slots.num_free == NUM_SLOTS
        assert pool_keys(running_pool) == before
        assert not any(k.startswith(WARM_KEY_PREFIX) for k in pool_keys(running_pool))


@pytest.mark.parametrize(
    ("shm", "enabled", "warmed"), [(True, True, True), (True, False, False), (False, True, False)]
)
def test_connect_warms_shared_memory_staging_only(running_pool, monkeypatch, shm, enabled, warmed):
    calls: list[KVPoolClient] = []
    monkeypatch.setattr(client_module, "warm_staging", lambda c: calls.append(c) or True)
    with KVPoolClient(config(running_pool, shm=shm, warm_staging=enabled)) as client:
        assert calls == ([client] if warmed else [])
        assert client.stats().keys_put == 0


def test_a_pool_too_small_skips_the_warm_up_and_the_client_works(tmp_path, caplog) -> None:
    pool = start_pool(tmp_path, size_bytes=16 << 20)  # Mooncake's smallest: 8 of 20 slots
    try:
        caplog.set_level(logging.WARNING, logger="workers.pool.warm_staging")
        # a batch of 16 slots of 2 MiB is twice the pool
        with KVPoolClient(config(pool.addresses, slot_bytes=2 << 20)) as client:
            assert any("staging warm-up stopped" in r.getMessage() for r in caplog.records)
            assert not any(k.startswith(WARM_KEY_PREFIX) for k in pool_keys(pool.addresses))
            slots = client.slots.allocate(1)
            client.buffer.slot(slots[0])[:] = 5
            assert client.put_from(["after-warm-up"], slots).ok
            client.slots.free(slots)
            assert client.slots.num_free == NUM_SLOTS
    finally:
        pool.stop()
