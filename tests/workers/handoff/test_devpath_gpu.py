"""The device-pointer handoff through the real pool on a GPU: P gathers into device staging
and puts device pointers, D gets into device staging and scatters, through
workers.handoff.writer.write_blocks and workers.handoff.reader.load_blocks as the workers
call them, over DevicePool chosen by the start-up self-test (workers/pool/handoff_path.py).

Real mooncake_master and `pdworker pool` (its mooncake_client started with MC_STORE_MEMCPY=1
and a pinned segment), Mooncake's CUDA wheel, two shared-memory clients in this process;
blocks scattered on both sides, the last one partial; D's cache must equal P's byte for byte
and no call may have fallen back. D's Follower (what a decode worker's prefetch runs) reads
behind P's writes over device pointers, part by part. Then a forced failure: Mooncake is
handed pointers it refuses (-600), and every group is redone through host staging, counted,
still exact.

Needs an NVIDIA GPU, CuPy and Mooncake's CUDA wheel; skipped elsewhere (with the CPU wheel
the self-test fails, and the device path is skipped naming why). On the GPU host:
    python -m pytest -q -m gpu tests/workers/handoff/test_devpath_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.wait import wait_until
from tests.workers.handoff.test_handoff_gpu import (
    CACHE_BLOCKS,
    GROUP_BLOCKS,
    STAGING_SLOTS,
    WAIT_S,
    Side,
    make_cache,
    prompt_keys,
    same_blocks,
    scattered,
)
from workers.handoff import reader, writer
from workers.handoff.follower import Follower
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.device_pool import DevicePool
from workers.pool.device_staging import DeviceStaging
from workers.pool.handoff_path import choose_handoff_path
from workers.pool.keys import is_partial_key

pytestmark = pytest.mark.gpu
seen_fallbacks: list[tuple[str, str]] = []


def connect(addr: Any, caches: list[Any]) -> tuple[KVPoolClient, str, str]:
    """As pd_worker connects: page-locked host staging, the GPU current on the call threads,
    then the path the self-test picks (the client, its path name and the reason)."""
    from kernels.tensor_refs import describe_cache

    config = PoolClientConfig(
        master_addr=addr.master_addr,
        metadata_url=addr.metadata_url,
        owner_addr=addr.owner_addr,
        num_slots=STAGING_SLOTS,
        slot_bytes=describe_cache(caches).geometry.slot_bytes,
        page_lock=True,
        cuda_device=0,
    )
    client = KVPoolClient(config).connect()
    path = choose_handoff_path("auto", client, 0, on_fallback=lambda *a: seen_fallbacks.append(a))
    return path.pool, path.name, path.reason


@pytest.fixture(scope="module")
def sides(cp: Any, running_pool: Any) -> Iterator[tuple[Side, Side]]:
    p_cache, d_cache = make_cache(cp, seed=21), make_cache(cp, None)
    (p_pool, p_name, why), (d_pool, d_name, _) = (
        connect(running_pool, p_cache),
        connect(running_pool, d_cache),
    )
    try:
        if (p_name, d_name) != ("device", "device"):
            pytest.skip(f"the device-pointer path is not available here: {why}")
        yield Side(p_pool, p_cache), Side(d_pool, d_cache)
    finally:
        cp.cuda.runtime.deviceSynchronize()
        p_pool.close()
        d_pool.close()


def move(p: Side, d: Side, keys: list[str], p_ids: list[int], d_ids: list[int], **kw: Any):
    wrote = writer.write_blocks(
        p.pool, p.kv_caches, keys, p_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S, **kw
    )
    read = reader.load_blocks(
        d.pool, d.kv_caches, keys, d_ids, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S, **kw
    )
    return wrote, read


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serialized"])
def test_device_pointers_move_a_scattered_prompt_byte_exact(
    cp: Any, sides: tuple[Side, Side], pipelined: bool
) -> None:
    p, d = sides
    assert isinstance(p.pool, DevicePool) and isinstance(d.pool, DevicePool)
    keys = prompt_keys(salt=31 if pipelined else 32)
    assert is_partial_key(keys[-1]) and len(keys) == 100
    p_ids, d_ids = scattered(len(keys), seed=31), scattered(len(keys), seed=32)
    d.kv_caches[:] = make_cache(cp, None)
    seen_fallbacks.clear()
    before = [side.pool.client.stats() for side in sides]
    wrote, read = move(p, d, keys, p_ids, d_ids, pipelined=pipelined)
    cp.cuda.runtime.deviceSynchronize()
    slot_bytes = p.pool.config.slot_bytes
    assert (wrote.num_written, wrote.num_bytes) == (len(keys), len(keys) * slot_bytes)
    assert (read.num_loaded, read.missing_keys) == (len(keys), ())
    assert same_blocks(cp, p.kv_caches, p_ids, d.kv_caches, d_ids)
    others = cp.asarray(sorted(set(range(CACHE_BLOCKS)) - set(d_ids)))
    assert all(bool((t[others] == 0xDEAD).all()) for t in d.kv_caches)
    assert seen_fallbacks == [], "a device call fell back to host staging"
    after = [side.pool.client.stats() for side in sides]
    assert after[0].keys_put - before[0].keys_put == len(keys)
    assert after[1].hits - before[1].hits == len(keys)
    for side in sides:
        side.pool.slots.check_integrity()
        assert side.pool.slots.num_free == STAGING_SLOTS
        assert side.pool.client.slots.num_free == STAGING_SLOTS  # host staging untouched


class RefusedPointers(DeviceStaging):
    """Device staging whose addresses handed to Mooncake are host memory outside every
    shared-memory registration: the wheel answers -600, as a transient device failure does.
    Its own copies (swap target, host fallback) use the real GPU memory."""

    def __init__(self, num_slots: int, slot_bytes: int, device_id: int) -> None:
        super().__init__(num_slots, slot_bytes, device_id)
        self._foreign = np.zeros(num_slots * slot_bytes, np.uint8)
        base = self._foreign.ctypes.data
        self.slot_ptrs = [base + s * slot_bytes for s in range(num_slots)]


def test_refused_device_calls_are_redone_through_host_staging(
    cp: Any, sides: tuple[Side, Side]
) -> None:
    p, d = sides
    forced = []
    for side in sides:
        client = side.pool.client
        staging = RefusedPointers(STAGING_SLOTS, client.config.slot_bytes, 0)
        forced.append(DevicePool(client, staging, on_fallback=lambda *a: seen_fallbacks.append(a)))
    keys = prompt_keys(salt=33)
    p_ids, d_ids = scattered(len(keys), seed=33), scattered(len(keys), seed=34)
    d.kv_caches[:] = make_cache(cp, None)
    seen_fallbacks.clear()
    try:
        wrote, read = move(Side(forced[0], p.kv_caches), Side(forced[1], d.kv_caches),
                           keys, p_ids, d_ids)  # fmt: skip
        cp.cuda.runtime.deviceSynchronize()
        assert (wrote.num_written, read.num_loaded) == (len(keys), len(keys))
        assert same_blocks(cp, p.kv_caches, p_ids, d.kv_caches, d_ids)
        groups = -(-len(keys) // GROUP_BLOCKS)
        expected = [("put", "bad_params")] * groups + [("get", "bad_params")] * groups
        assert seen_fallbacks == expected
    finally:
        for pool, side in zip(forced, sides, strict=True):
            pool.staging.close()
            side.pool.client.use_device_staging(side.pool.staging)  # back to the real one


def test_the_follower_reads_behind_the_writes_on_device_pointers(
    cp: Any, sides: tuple[Side, Side]
) -> None:
    """D's Follower over DevicePool (its reads on the follower's thread, the Mooncake calls on
    the client's call threads with the GPU current) takes each part P writes before the next
    part exists, and ends byte-exact with no fallback."""
    p, d = sides
    keys = prompt_keys(salt=35)
    p_ids, d_ids = scattered(len(keys), seed=35), scattered(len(keys), seed=36)
    d.kv_caches[:] = make_cache(cp, None)
    seen_fallbacks.clear()
    follower = Follower(
        lambda: d.pool, d.kv_caches, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S, poll_s=0.002
    )
    follow = follower.add(keys, d_ids, None)
    for first, end in ((0, 30), (30, 70), (70, len(keys))):  # as a chunked prefill writes
        writer.write_blocks(p.pool, p.kv_caches, keys[first:end], p_ids[first:end],
                            group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)  # fmt: skip
        wait_until(lambda end=end: follow.num_loaded == end, 30, f"D read blocks [0, {end})")
    outcome = follow.done.result(timeout=30)
    cp.cuda.runtime.deviceSynchronize()
    assert (outcome.num_loaded, outcome.missing_keys) == (len(keys), ())
    assert same_blocks(cp, p.kv_caches, p_ids, d.kv_caches, d_ids)
    assert seen_fallbacks == [], "a device call fell back to host staging"
    d.pool.slots.check_integrity()
    assert d.pool.slots.num_free == STAGING_SLOTS
