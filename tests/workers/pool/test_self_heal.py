"""The pool client heals itself: a pause that loses the owner's mapping, an owner that hangs,
an owner that dies and comes back. Real master, real owner, real client processes; the faults
are real signals. While the pool is lost, health() says degraded and calls fail fast."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.wait import wait_until
from tests.workers.pool.actor import digest, pattern
from tests.workers.pool.fixtures import client_config, start_pool
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import KeyStatus, PoolDegradedError
from workers.pool.local_pool import LocalPool
from workers.pool.shm_table import SHM_TABLE

MiB = 1 << 20
# The owner drops a shared-memory client it has not heard from for 10 s (its fixed TTL), and
# looks every 100 ms or so: 13 s of silence is past it under any load.
PAST_OWNER_TTL_S = 13.0
HEAL_BOUND_S = 10.0
FAST_S = 0.2  # a call on a degraded client answers without reaching Mooncake


@pytest.fixture
def own_pool(tmp_path) -> Iterator[LocalPool]:
    pool = start_pool(tmp_path / "pool", size_bytes=64 * MiB)
    try:
        yield pool
    finally:
        pool.stop()


def _round_trip(client: KVPoolClient, tag: str) -> list[str]:
    """Put two slots under fresh keys and read them back: the statuses of the get."""
    slots = client.slots.allocate(2)
    assert slots is not None
    try:
        keys = [f"heal/{tag}/{i}" for i in range(2)]
        for i, slot in enumerate(slots):
            client.buffer.slot(slot)[:] = pattern(7, i, MiB)
        put = client.put_from(keys, slots)
        if not put.ok:
            return [s.value for s in put.statuses]
        client.buffer.view[slots] = 0
        got = client.get_into(keys, slots)
        ok = [
            np.array_equal(client.buffer.slot(s), pattern(7, i, MiB)) for i, s in enumerate(slots)
        ]
        return [s.value if good else "corrupt" for s, good in zip(got.statuses, ok, strict=True)]
    finally:
        client.slots.free(slots)


def _client(
    pool: LocalPool, registry: CollectorRegistry | None = None, **overrides: float
) -> KVPoolClient:
    a = pool.addresses
    config = PoolClientConfig(
        master_addr=a.master_addr,
        metadata_url=a.metadata_url,
        owner_addr=a.owner_addr,
        num_slots=4,
        slot_bytes=MiB,
        call_timeout_s=3.0,
        **overrides,  # type: ignore[arg-type]
    )
    return KVPoolClient(config, registry=registry).connect()


def _gauge(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("pdworker_pool_degraded")


@pytest.mark.slow
def test_a_worker_paused_past_the_owner_ttl_reconnects_by_itself(own_pool, actors):
    # The owner unmaps the staging of a client whose pings stopped for 10 s; the client's
    # ping thread succeeds again after SIGCONT and never notices: without the probe, every
    # later put and get of this process answers -600 for good.
    worker = actors("worker")
    config = client_config(own_pool.addresses, "shm", num_slots=4, slot_bytes=MiB)
    assert worker.call("connect", **config)["ok"]
    assert worker.call("put", keys=["before"], seed=1)["statuses"] == ["ok"]
    worker.proc.freeze()
    try:
        time.sleep(PAST_OWNER_TTL_S)  # the fault itself: a pause of this length
    finally:
        worker.proc.signal(signal.SIGCONT)
    keys = [f"after/{i}" for i in range(4)]
    wait_until(
        lambda: worker.call("put", keys=keys, seed=2)["statuses"], HEAL_BOUND_S,
        "the paused worker's puts to work again", done=lambda s: s == ["ok"] * 4,
        interval_s=0.2,
    )  # fmt: skip
    got = worker.call("get", keys=keys)
    assert got["statuses"] == ["ok"] * 4
    assert got["digests"] == [digest(pattern(2, i, MiB)) for i in range(4)]
    health = worker.call("health")
    assert (health["state"], health["reason"]) == ("ok", None)
    assert health["generation"] == 1  # it did reconnect, once


@pytest.mark.slow
def test_a_hung_owner_makes_the_client_degraded_and_fast_then_healthy(own_pool):
    registry = CollectorRegistry()
    client = _client(own_pool, registry)
    try:
        assert _round_trip(client, "before") == ["ok", "ok"]
        assert client.health().state == "ok" and _gauge(registry) == 0
        own_pool.owner.freeze()
        try:
            health = wait_until(
                client.health, HEAL_BOUND_S, "degraded while the owner hangs",
                done=lambda h: h.state == "degraded",
            )  # fmt: skip
            assert "did not answer" in (health.reason or ""), health
            assert _gauge(registry) == 1
            t0 = time.monotonic()
            got = client.get_into(["k"], [0])
            assert got.statuses == (KeyStatus.UNAVAILABLE,)
            assert isinstance(got.error(), PoolDegradedError)
            with pytest.raises(PoolDegradedError):
                client.exists(["k"])
            assert time.monotonic() - t0 < FAST_S
            time.sleep(PAST_OWNER_TTL_S)  # the fault: a pause past the owner's TTL
        finally:
            own_pool.owner.signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(
            lambda: _round_trip(client, "after"), HEAL_BOUND_S,
            "the handoff through the pool after SIGCONT", done=lambda s: s == ["ok", "ok"],
            interval_s=0.2,
        )  # fmt: skip
        assert time.monotonic() - resumed < HEAL_BOUND_S
        assert client.health().state == "ok" and _gauge(registry) == 0
    finally:
        client.close()


@pytest.mark.slow
def test_a_dead_owner_restarted_on_its_ports_is_found_again(own_pool):
    registry = CollectorRegistry()
    client = _client(own_pool, registry)
    try:
        assert _round_trip(client, "before") == ["ok", "ok"]
        own_pool.owner.kill()
        wait_until(
            client.health, HEAL_BOUND_S, "degraded while the owner is dead",
            done=lambda h: h.state == "degraded",
        )  # fmt: skip
        assert _gauge(registry) == 1
        t0 = time.monotonic()
        assert client.put_from(["k"], [0]).statuses == (KeyStatus.UNAVAILABLE,)
        assert time.monotonic() - t0 < FAST_S
        own_pool.start_owner(keep_ports=True)
        restarted = time.monotonic()
        wait_until(
            lambda: _round_trip(client, "after"), 15.0,
            "the handoff through the restarted owner", done=lambda s: s == ["ok", "ok"],
            interval_s=0.2,
        )  # fmt: skip
        assert time.monotonic() - restarted < 15.0
        assert client.health().state == "ok" and _gauge(registry) == 0
    finally:
        client.close()


@pytest.mark.slow
def test_no_new_link_while_mooncakes_own_reconnection_walks_the_table(own_pool):
    # With the master down the owner is up but unhealthy: the client's ping fails, and its
    # Mooncake loop walks the process's shared-memory table every 2 s. A new link then would
    # change the table under that walk (a SIGSEGV, seen once: workers/pool/shm_table.py), so
    # none is made until the loop ends. The probe and the reconnect are called here, one at a
    # time, rather than by the client's thread.
    client = _client(own_pool, probe_interval_s=0.0, setup_timeout_s=1.0)
    try:
        assert _round_trip(client, "before") == ["ok", "ok"]
        first = client._link
        own_pool.master.proc.kill()  # type: ignore[union-attr]
        owner = own_pool.addresses.owner_addr
        wait_until(SHM_TABLE.walking, HEAL_BOUND_S, "Mooncake's loop", done=lambda w: w == [owner])
        outcome = client._probe()
        assert "Mooncake's own reconnection is running" in (outcome.reason or ""), outcome
        assert not outcome.reachable
        assert client._reconnect() is False  # ShmTableBusy: the table was left as it was
        assert client._link is first
        own_pool.master.start(keep_ports=True)  # the owner is healthy again: the loop ends
        wait_until(SHM_TABLE.walking, 15.0, "Mooncake's loop to end", done=lambda w: w == [])
        assert client._reconnect() is True  # a new link now
        assert client._link is not first
        assert client._probe().reason is None
        assert _round_trip(client, "after") == ["ok", "ok"]
        assert client.close()
        # Closed, it answers not-initialized while its owner lives: no longer asked, it
        # holds up no addition.
        assert SHM_TABLE.walking() == []
    finally:
        client.close()
