"""A reader of larger TP than its writer, on the GPU: a 1-rank P writes Llama-3-8B-shaped
blocks whole (8 KV heads, `h0-8of8`); the two ranks of a 2-rank D, each a CuPy cache of its
4 heads with its own pool client, read every block into their heads (the whole object into a
staging slot, then only the rank's heads into the cache: swap_cache_layout's host_heads).
Each rank's cache must equal its heads of P's blocks byte for byte, and no other block of it
may change. Through host staging (page-locked) and through the device-pointer path, each
rank's pool as a rank > 0 picks it (workers.engine.tp.peer.rank_pool).

Needs an NVIDIA GPU, CuPy and the Mooncake wheel; skipped elsewhere.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from workers.engine.tp.peer import rank_pool
from workers.engine.tp.rank_io import read_rank, write_rank
from workers.engine.tp.sharded_pool import ShardedPool
from workers.engine.tp.shards import HeadRange, rank_heads
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.device_pool import DevicePool
from workers.pool.keys import block_keys, is_partial_key

pytestmark = pytest.mark.gpu

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 8, 16, 128  # 8B's per-layer KV, fewer layers
CACHE_BLOCKS, NUM_BLOCKS, GROUP, SLOTS, WAIT_S = 96, 64, 16, 32, 30.0
POISON = 0xDEAD


def _connect(addr: Any) -> KVPoolClient:
    slot_bytes = 2 * LAYERS * HEADS * BLOCK_SIZE * HEAD_DIM * 2  # a block of every head
    config = PoolClientConfig(
        master_addr=addr.master_addr, metadata_url=addr.metadata_url, owner_addr=addr.owner_addr,
        num_slots=SLOTS, slot_bytes=slot_bytes, page_lock=True, cuda_device=0,
    )  # fmt: skip
    return KVPoolClient(config).connect()


def _ids(seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(CACHE_BLOCKS)[:NUM_BLOCKS].tolist()


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_tp2_reader_cuts_its_heads_out_of_a_tp1_writers_blocks(
    cp: Any, running_pool: Any, path: str
) -> None:
    tokens = [(i * 31 + len(path)) % 32000 for i in range(NUM_BLOCKS * BLOCK_SIZE - 5)]
    keys = block_keys(f"tp-cut-{path}", tokens, BLOCK_SIZE)
    assert len(keys) == NUM_BLOCKS and is_partial_key(keys[-1])
    rng = cp.random.default_rng(11)
    shape = (CACHE_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM)
    whole = [rng.integers(0, 1 << 16, shape, dtype=cp.uint16) for _ in range(2 * LAYERS)]
    p_ids, d_ids = _ids(1), _ids(2)
    writer = _connect(running_pool)
    clients = [_connect(running_pool) for _ in range(2)]
    pools = [rank_pool(c, path, 0) for c in clients]  # as a rank > 0 picks its path
    try:
        assert all(isinstance(p, DevicePool) == (path == "device") for p in pools)
        out = write_rank(
            writer, whole, HeadRange(0, HEADS, HEADS), p_ids, keys, GROUP, time.monotonic() + WAIT_S
        )
        assert all(r.ok for r in out.results)
        for rank, pool in enumerate(pools):
            own = rank_heads(HEADS, 2, rank)
            # The layout probe finds the 1-rank writer's blocks for a 2-rank reader on a GPU.
            assert ShardedPool(pool, 2, HEADS, None).best_layout(keys) == 1
            cache = [cp.full((CACHE_BLOCKS, own.count, BLOCK_SIZE, HEAD_DIM), POISON, cp.uint16)
                     for _ in whole]  # fmt: skip
            got = read_rank(pool, cache, own, 1, d_ids, keys, GROUP, time.monotonic() + WAIT_S)
            cp.cuda.runtime.deviceSynchronize()
            assert (got.num_loaded, got.missing_keys) == (NUM_BLOCKS, ())
            src, dst = cp.asarray(p_ids), cp.asarray(d_ids)
            others = cp.asarray(sorted(set(range(CACHE_BLOCKS)) - set(d_ids)))
            for mine, theirs in zip(cache, whole, strict=True):
                assert bool(cp.array_equal(mine[dst], theirs[src][:, own.start : own.end]))
                assert bool((mine[others] == POISON).all())
    finally:
        cp.cuda.runtime.deviceSynchronize()
        writer.close()
        for pool in pools:
            pool.close()
