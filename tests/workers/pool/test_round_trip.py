"""Blocks written by one process, read by another, pool owned by a third: byte-exact."""

from __future__ import annotations

import pytest

from tests.workers.pool.actor import digest, pattern
from tests.workers.pool.fixtures import client_config
from workers.pool.keys import block_keys, model_fingerprint

SLOT_BYTES = 256 << 10
NUM_BLOCKS = 64
FINGERPRINT = model_fingerprint("tiny", "float16", 2, 2, 16, 16)


def _keys(tag: str, num_blocks: int) -> list[str]:
    token_ids = list(range(num_blocks * 16))
    return block_keys(FINGERPRINT, token_ids, 16, namespace=f"rt-{tag}")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_64_blocks_round_trip_byte_exact(running_pool, actors, transport):
    config = client_config(running_pool, transport, num_slots=NUM_BLOCKS, slot_bytes=SLOT_BYTES)
    writer, reader = actors("writer"), actors("reader")
    assert writer.call("connect", **config)["ok"]
    assert reader.call("connect", **config)["ok"]
    keys = _keys(transport, NUM_BLOCKS)

    put = writer.call("put", keys=keys, seed=7)
    assert put["ok"] and put["statuses"] == ["ok"] * NUM_BLOCKS

    got = reader.call("get", keys=keys)
    assert got["ok"] and got["statuses"] == ["ok"] * NUM_BLOCKS
    assert got["codes"] == [SLOT_BYTES] * NUM_BLOCKS
    assert got["digests"] == [digest(pattern(7, i, SLOT_BYTES)) for i in range(NUM_BLOCKS)]
    assert got["error"] is None

    assert reader.call("exists", keys=[*keys[:2], keys[0] + "-never"])["exists"] == [
        True,
        True,
        False,
    ]
    stats = reader.call("stats")["stats"]
    assert stats["bytes_got"] == NUM_BLOCKS * SLOT_BYTES
    assert (stats["hits"], stats["misses"], stats["errors"]) == (NUM_BLOCKS, 0, {})
    assert writer.call("stats")["stats"]["bytes_put"] == NUM_BLOCKS * SLOT_BYTES


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_put_of_existing_key_succeeds_and_keeps_first_value(running_pool, actors, transport):
    config = client_config(running_pool, transport, num_slots=4, slot_bytes=SLOT_BYTES)
    writer, reader = actors("writer"), actors("reader")
    writer.call("connect", **config)
    reader.call("connect", **config)
    keys = _keys(f"dup-{transport}", 4)
    assert writer.call("put", keys=keys[:2], seed=1)["statuses"] == ["ok", "ok"]
    # Same keys, different bytes: success, and readers still see the first value.
    assert writer.call("put", keys=keys, seed=2)["statuses"] == ["ok"] * 4
    got = reader.call("get", keys=keys)
    assert got["digests"] == [
        digest(pattern(1, 0, SLOT_BYTES)),
        digest(pattern(1, 1, SLOT_BYTES)),
        digest(pattern(2, 2, SLOT_BYTES)),
        digest(pattern(2, 3, SLOT_BYTES)),
    ]


def test_partial_block_is_stored_at_its_own_size(running_pool, actors):
    config = client_config(running_pool, "tcp", num_slots=2, slot_bytes=SLOT_BYTES)
    writer, reader = actors("writer"), actors("reader")
    writer.call("connect", **config)
    reader.call("connect", **config)
    full_key, partial_key = block_keys(FINGERPRINT, list(range(16 + 5)), 16, namespace="rt-p")
    assert partial_key.endswith(":partial:5")
    partial_bytes = SLOT_BYTES * 5 // 16
    put = writer.call(
        "put", keys=[full_key, partial_key], seed=3, sizes=[SLOT_BYTES, partial_bytes]
    )
    assert put["statuses"] == ["ok", "ok"]
    got = reader.call("get", keys=[full_key, partial_key])
    assert got["codes"] == [SLOT_BYTES, partial_bytes]
    assert got["digests"] == [
        digest(pattern(3, 0, SLOT_BYTES)),
        digest(pattern(3, 1, SLOT_BYTES)[:partial_bytes]),
    ]


def test_remove_then_get_reports_missing(running_pool, actors):
    config = client_config(running_pool, "tcp", num_slots=3, slot_bytes=SLOT_BYTES)
    writer, reader = actors("writer"), actors("reader")
    writer.call("connect", **config)
    reader.call("connect", **config)
    keys = _keys("rm", 3)
    writer.call("put", keys=keys[:2], seed=4)
    # keys[2] was never written: removing it reports missing, the others succeed.
    assert reader.call("remove", keys=keys)["statuses"] == ["ok", "ok", "missing"]
    got = reader.call("get", keys=keys)
    assert got["statuses"] == ["missing"] * 3
    assert got["error"] == "KeyMissingError"
    assert reader.call("exists", keys=keys)["exists"] == [False] * 3
