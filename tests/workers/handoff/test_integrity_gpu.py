"""Pool blocks that prove their content on the device-pointer path, on a GPU.

The GPU word sum (workers/pool/payload_checksum.py) bit for bit against its CPU spec over a
grid of sizes and scattered slots; device staging's checksums of either kind; then the
handoff through the real pool (Mooncake's CUDA wheel) with CheckedPool over DevicePool:
byte-exact with no fallback, a corrupt block a counted miss at exactly its place (both its
objects removed), and blocks sealed on the device path read through host staging (their word
sum checked on the CPU).

On the GPU host:
    python -m pytest -q -m gpu tests/workers/handoff/test_integrity_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.workers.handoff.test_devpath_gpu import connect, seen_fallbacks
from tests.workers.handoff.test_handoff_gpu import (
    BLOCK_SIZE,
    GROUP_BLOCKS,
    WAIT_S,
    make_cache,
    prompt_keys,
    same_blocks,
    scattered,
)
from workers.handoff import reader, writer
from workers.pool.checked_pool import CheckedPool
from workers.pool.device_pool import DevicePool
from workers.pool.device_staging import DeviceStaging
from workers.pool.keys import header_key
from workers.pool.object_header import CHECKSUM_WORDSUM, CHECKSUM_XXH3
from workers.pool.payload_checksum import DeviceWordsum, wordsum_reference, xxh3

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("payload_bytes", [4, 12, 16, 4096 + 4, 2 << 20])
def test_the_gpu_word_sum_is_its_cpu_spec_bit_for_bit(cp: Any, payload_bytes: int) -> None:
    num_slots = 5
    stride = (payload_bytes + 15) // 16 * 16 + 16  # 16-byte aligned slots, a poisoned gap
    rng = np.random.default_rng(payload_bytes)
    host = rng.integers(0, 256, num_slots * stride, dtype=np.uint8)
    device = cp.asarray(host)
    slots = [3, 0, 4]
    got = DeviceWordsum(0)([device.data.ptr + s * stride for s in slots], payload_bytes)
    want = [wordsum_reference(host[s * stride : s * stride + payload_bytes]) for s in slots]
    assert got == want


def test_device_staging_checksums_are_the_word_sum_of_its_slots(cp: Any) -> None:
    staging = DeviceStaging(8, 4096, 0)
    try:
        payload = np.random.default_rng(3).integers(0, 256, (2, 4096), dtype=np.uint8)
        for row, slot in enumerate((5, 2)):
            src = cp.asarray(payload[row])
            cp.cuda.runtime.memcpy(staging.slot_ptrs[slot], src.data.ptr, 4096, 4)
        want = [wordsum_reference(payload[0]), wordsum_reference(payload[1])]
        assert staging.checksums([5, 2], CHECKSUM_WORDSUM) == want
        assert staging.checksums([5], CHECKSUM_XXH3) == [xxh3(payload[0])]
    finally:
        staging.close()


@pytest.fixture(scope="module")
def checked(cp: Any, running_pool: Any) -> Iterator[tuple[Any, Any, list, list, list]]:
    """P and D on the device path behind CheckedPool, and the failure reasons counted."""
    p_cache, d_cache = make_cache(cp, seed=41), make_cache(cp, None)
    (p_pool, p_name, why), (d_pool, d_name, _) = (
        connect(running_pool, p_cache),
        connect(running_pool, d_cache),
    )
    reasons: list[str] = []
    try:
        if (p_name, d_name) != ("device", "device"):
            pytest.skip(f"the device-pointer path is not available here: {why}")
        p_checked = CheckedPool(p_pool, BLOCK_SIZE, reasons.append)
        d_checked = CheckedPool(d_pool, BLOCK_SIZE, reasons.append)
        yield p_checked, d_checked, p_cache, d_cache, reasons
    finally:
        cp.cuda.runtime.deviceSynchronize()
        p_pool.close()
        d_pool.close()


def _move(p: Any, d: Any, p_cache: list, d_cache: list, keys: list[str], salt: int):
    p_ids, d_ids = scattered(len(keys), seed=salt), scattered(len(keys), seed=salt + 1)
    wrote = writer.write_blocks(p, p_cache, keys, p_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)
    read = reader.load_blocks(d, d_cache, keys, d_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)
    return wrote, read, p_ids, d_ids


def test_checked_device_path_is_byte_exact_and_catches_a_corrupt_block(
    cp: Any, checked: tuple
) -> None:
    p, d, p_cache, d_cache, reasons = checked
    assert isinstance(p.inner, DevicePool)
    keys = prompt_keys(salt=51)
    seen_fallbacks.clear()
    wrote, read, p_ids, d_ids = _move(p, d, p_cache, d_cache, keys, salt=51)
    cp.cuda.runtime.deviceSynchronize()
    assert (wrote.num_written, read.num_loaded, read.missing_keys) == (len(keys), len(keys), ())
    assert same_blocks(cp, p_cache, p_ids, d_cache, d_ids) and reasons == []
    assert seen_fallbacks == [], "a device call fell back to host staging"

    # Block 5 replaced by block 4, payload and header (a stale or swapped write).
    client = p.inner.client
    slot = client.slots.allocate(1)
    try:
        assert client.get_into([keys[4]], slot).ok
        assert client.get_into([header_key(keys[4])], slot, headers=True).ok
        assert client.remove([keys[5], header_key(keys[5])], force=True).ok
        assert client.put_from([keys[5]], slot).ok
        assert client.put_from([header_key(keys[5])], slot, [64], headers=True).ok
    finally:
        client.slots.free(slot)
    d_cache[:] = make_cache(cp, None)
    read = reader.load_blocks(d, d_cache, keys, d_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)
    cp.cuda.runtime.deviceSynchronize()
    assert (read.num_loaded, read.missing_keys, reasons) == (5, (keys[5],), ["key"])
    assert same_blocks(cp, p_cache, p_ids[:5], d_cache, d_ids[:5])
    assert client.exists([keys[5], header_key(keys[5])]) == [False, False]


def test_an_object_sealed_on_the_device_reads_through_host_staging(cp: Any, checked: tuple) -> None:
    p, d, p_cache, d_cache, reasons = checked
    keys = prompt_keys(salt=61)[:20]
    p_ids, d_ids = scattered(len(keys), seed=61), scattered(len(keys), seed=62)
    writer.write_blocks(p, p_cache, keys, p_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)
    host_reader = CheckedPool(d.inner.client, BLOCK_SIZE, reasons.append)  # host staging
    d_cache[:] = make_cache(cp, None)
    before = list(reasons)
    read = reader.load_blocks(host_reader, d_cache, keys, d_ids, group_blocks=8, wait_s=WAIT_S)
    cp.cuda.runtime.deviceSynchronize()
    assert (read.num_loaded, reasons) == (len(keys), before)
    assert same_blocks(cp, p_cache, p_ids, d_cache, d_ids)
