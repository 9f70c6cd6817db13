"""Pool objects that prove their content, through a real master and owner (shared memory):
P writes a prompt's blocks through CheckedPool (the real writer), one object is then
corrupted in the pool, and D reads through CheckedPool (the real reader). Each corruption
is a miss at exactly that block, counted by its reason, and removed from the pool; D's cache
holds P's bytes for every block before it and nothing after.

The corrupt blocks are made with the same client's raw puts (a payload and a header object,
or a payload of another length): what a stale, foreign or broken writer would leave under a
key. A block is two objects (workers/pool/checked_pool.py says why); one half missing is a
plain miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kernels.tensor_refs import bytes_per_slot
from tests.workers.pool.fixtures import client_config
from workers.handoff.reader import load_blocks
from workers.handoff.writer import write_blocks
from workers.pool.checked_pool import CheckedPool
from workers.pool.client import KVPoolClient
from workers.pool.client_config import PoolClientConfig
from workers.pool.errors import CORRUPT_CODE, KeyStatus
from workers.pool.keys import block_keys, header_key
from workers.pool.object_header import ExpectedObject
from workers.pool.payload_checksum import xxh3

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, DIM = 2, 8, 2, 4, 8
FP, OTHER_FP = "00112233aabbccdd", "99887766ffeeddcc"
NUM_TOKENS = 5 * BLOCK_SIZE + 2  # 5 full blocks and a partial tail of 2 tokens
WAIT_S = 10.0


def _cache(seed: int | None) -> list[np.ndarray]:
    """[K0, V0, K1, V1], each [num_blocks, heads, block_size, dim]; random, or zeros."""
    shape = (BLOCKS, HEADS, BLOCK_SIZE, DIM)
    if seed is None:
        return [np.zeros(shape, np.uint16) for _ in range(2 * LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65535, shape, dtype=np.uint16) for _ in range(2 * LAYERS)]


@pytest.fixture(scope="module")
def client(running_pool: Any) -> Iterator[KVPoolClient]:
    slot_bytes = bytes_per_slot(_cache(None))
    config = client_config(running_pool, "shm", num_slots=16, slot_bytes=slot_bytes)
    config.update(warm_staging=False, probe_interval_s=0)
    with KVPoolClient(PoolClientConfig(**config)) as pool_client:
        yield pool_client


class Reasons(list):
    def __call__(self, reason: str) -> None:
        self.append(reason)


def _keys(salt: int, fingerprint: str = FP) -> list[str]:
    return block_keys(fingerprint, [salt * 1000 + t for t in range(NUM_TOKENS)], BLOCK_SIZE)


def _replace(client: KVPoolClient, key: str, fill: Callable[[Any, int], int | None]) -> None:
    """Replace the block under key (payload and header object) by what fill(staging, slot)
    leaves in one slot and its header bytes; fill returns a payload length to put a shorter
    payload (None: the whole slot)."""
    slot = client.slots.allocate(1)
    assert slot is not None
    try:
        length = fill(client.buffer, slot[0])
        assert client.remove([key, header_key(key)], force=True).ok  # a read may lease them
        assert client.put_from([key], slot, None if length is None else [length]).ok
        assert client.put_from([header_key(key)], slot, [64], headers=True).ok
    finally:
        client.slots.free(slot)


def _sealed(key_in_header: str) -> Callable[[Any, int], None]:
    """A well-formed block of random payload, sealed as the block of key_in_header."""

    def fill(staging: Any, slot: int) -> None:
        staging.view[slot] = np.random.default_rng(7).integers(0, 256, staging.slot_bytes)
        expected = ExpectedObject.for_key(key_in_header, BLOCK_SIZE, staging.slot_bytes)
        header = expected.header(xxh3(staging.view[slot]), staging.checksum_kind)
        staging.write_headers([slot], np.frombuffer(header.encode(), np.uint8).reshape(1, -1))

    return fill


def _corruptions(keys: list[str]) -> dict[str, Callable[[Any, int], Any]]:
    """reason -> how the block under keys[2] is replaced."""
    good = _sealed(keys[2])

    def payload_flipped(staging: Any, slot: int) -> None:
        good(staging, slot)
        staging.view[slot][100] ^= 0x01  # one bit of the payload after it was sealed

    def junk(staging: Any, slot: int) -> None:
        staging.view[slot] = 0xA5
        staging.headers[slot] = 0xA5

    def truncated(staging: Any, slot: int) -> int:
        good(staging, slot)
        return staging.slot_bytes // 2

    return {
        "checksum": payload_flipped,
        "version": junk,  # both objects overwritten with other bytes
        "length": truncated,
        "fingerprint": _sealed(_keys(3, OTHER_FP)[2]),  # another model's, forged key
        "tokens": _sealed(keys[-1]),  # this prompt's partial tail, as a full block
        "key": _sealed(keys[1]),  # another block of this prompt
    }


REASONS = ["checksum", "version", "length", "fingerprint", "tokens", "key"]


@pytest.mark.parametrize("reason", REASONS)
def test_a_corrupt_object_is_a_counted_miss_and_is_removed(
    client: KVPoolClient, reason: str
) -> None:
    reasons = Reasons()
    pool = CheckedPool(client, BLOCK_SIZE, reasons)
    keys = _keys(salt=10 + REASONS.index(reason))
    source, target = _cache(seed=REASONS.index(reason)), _cache(None)
    ids = list(range(len(keys)))
    written = write_blocks(pool, source, keys, ids, group_blocks=4, wait_s=WAIT_S)
    assert (written.num_written, written.num_skipped) == (len(keys), 0)

    _replace(client, keys[2], _corruptions(keys)[reason])
    loaded = load_blocks(pool, target, keys, ids, group_blocks=4, wait_s=WAIT_S)

    assert (loaded.num_loaded, loaded.missing_keys) == (2, (keys[2],))
    assert list(reasons) == [reason]
    for layer_src, layer_dst in zip(source, target, strict=True):
        assert np.array_equal(layer_dst[:2], layer_src[:2])  # P's bytes, exactly
        assert not layer_dst[2:].any()  # nothing past the miss
    assert pool.exists(keys) == [True, True, False, True, True, True]
    assert client.exists([keys[2], header_key(keys[2])]) == [False, False]
    # The next writer puts it again (the pool lacks it), and it then reads back whole.
    again = write_blocks(pool, source, keys, ids, group_blocks=4, wait_s=WAIT_S)
    assert (again.num_written, again.num_skipped) == (1, len(keys) - 1)
    full = load_blocks(pool, target, keys, ids, group_blocks=4, wait_s=WAIT_S)
    assert (full.num_loaded, full.missing_keys, list(reasons)) == (len(keys), (), [reason])
    for layer_src, layer_dst in zip(source, target, strict=True):
        assert np.array_equal(layer_dst[: len(keys)], layer_src[: len(keys)])
    client.slots.check_integrity()


def test_a_corrupt_key_answers_corrupt_and_the_rest_of_the_batch_reads(
    client: KVPoolClient,
) -> None:
    reasons = Reasons()
    pool = CheckedPool(client, BLOCK_SIZE, reasons)
    keys = _keys(salt=99)
    source = _cache(seed=99)
    write_blocks(pool, source, keys, list(range(len(keys))), group_blocks=8, wait_s=WAIT_S)
    _replace(client, keys[4], _sealed(keys[0]))
    slots = client.slots.allocate(len(keys))
    assert slots is not None
    try:
        result = pool.get_into(keys, slots)
    finally:
        client.slots.free(slots)
    assert result.codes[4] == CORRUPT_CODE
    assert [s for i, s in enumerate(result.statuses) if i != 4] == [KeyStatus.OK] * 5
    assert result.statuses[4] is KeyStatus.CORRUPT and list(reasons) == ["key"]


@pytest.mark.parametrize("half", ["payload", "header"])
def test_a_block_missing_one_half_is_a_plain_miss_and_the_other_half_goes(
    client: KVPoolClient, half: str
) -> None:
    # Evicted alone, or a writer that died between its two puts: not corruption, no count;
    # the remaining half is removed so that exists() no longer claims the block.
    reasons = Reasons()
    pool = CheckedPool(client, BLOCK_SIZE, reasons)
    keys = _keys(salt=70 + len(half))
    source, target = _cache(seed=70), _cache(None)
    ids = list(range(len(keys)))
    write_blocks(pool, source, keys, ids, group_blocks=8, wait_s=WAIT_S)
    gone = keys[3] if half == "payload" else header_key(keys[3])
    assert client.remove([gone], force=True).ok
    loaded = load_blocks(pool, target, keys, ids, group_blocks=8, wait_s=WAIT_S)
    assert (loaded.num_loaded, loaded.missing_keys, list(reasons)) == (3, (keys[3],), [])
    assert client.exists([keys[3], header_key(keys[3])]) == [False, False]


def test_blocks_without_a_header_are_misses_for_a_checked_reader(
    client: KVPoolClient,
) -> None:
    # A worker with --pool-integrity off writes payloads alone: a checked reader reads none
    # of them as KV, and removes them (its own writes then put both halves).
    reasons = Reasons()
    keys = _keys(salt=90)
    source, target = _cache(seed=90), _cache(None)
    ids = list(range(len(keys)))
    write_blocks(client, source, keys, ids, group_blocks=8, wait_s=WAIT_S)
    pool = CheckedPool(client, BLOCK_SIZE, reasons)
    assert pool.exists(keys) == [False] * len(keys)
    loaded = load_blocks(pool, target, keys, ids, group_blocks=8, wait_s=WAIT_S)
    assert (loaded.num_loaded, list(reasons)) == (0, [])
    assert client.exists(keys) == [False] * len(keys)
    assert not any(layer.any() for layer in target)


def test_a_payload_or_header_too_long_to_read_is_told_by_its_length(
    client: KVPoolClient, running_pool: Any
) -> None:
    # Mooncake refuses to read an object into a smaller buffer (-600, as for other causes):
    # the pool is then asked the object's length.
    reasons = Reasons()
    pool = CheckedPool(client, BLOCK_SIZE, reasons)
    keys = _keys(salt=95)
    source, target = _cache(seed=95), _cache(None)
    ids = list(range(len(keys)))
    write_blocks(pool, source, keys, ids, group_blocks=8, wait_s=WAIT_S)
    config = client_config(
        running_pool, "shm", num_slots=2, slot_bytes=2 * client.config.slot_bytes
    )
    config.update(warm_staging=False, probe_interval_s=0)
    with KVPoolClient(PoolClientConfig(**config)) as big:
        slot = big.slots.allocate(1)
        long_payload, long_header = client.config.slot_bytes + 100, 128
        for key, size in ((keys[1], long_payload), (header_key(keys[3]), long_header)):
            assert big.remove([key], force=True).ok
            assert big.put_from([key], slot, [size]).ok
    loaded = load_blocks(pool, target, keys, ids, group_blocks=8, wait_s=WAIT_S)
    # One group: every block of it is checked, and both bad ones counted and removed.
    assert (loaded.num_loaded, loaded.missing_keys) == (1, (keys[1], keys[3]))
    assert list(reasons) == ["length", "version"]
    assert (
        client.exists([keys[1], header_key(keys[1]), keys[3], header_key(keys[3])]) == [False] * 4
    )
    write_blocks(pool, source, keys, ids, group_blocks=8, wait_s=WAIT_S)
    loaded = load_blocks(pool, target, keys, ids, group_blocks=8, wait_s=WAIT_S)
    assert (loaded.num_loaded, loaded.missing_keys, len(reasons)) == (len(keys), (), 2)
