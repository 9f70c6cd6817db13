"""D following P's writes (workers.handoff.follow.follow_blocks) through the real pool: a real
mooncake_master and pool owner, a writer client and a reader client over shared memory, numpy
KV caches on both sides.

A writer thread puts the prompt's blocks group by group while the follower runs: the follower
has copied the first groups before the last one is put, and D's cache ends equal to P's byte
for byte. A stop or a deadline ends the follow with what it read; a key the pool says it holds
but will not give (as a put still in flight answers) is never copied, and read once it is.
The Follower (D's one thread for every reservation) asks the pool once per tick for all of
them, reads each as it lands, and ends a stopped one at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from kernels.tensor_refs import describe_cache
from tests.wait import wait_until
from workers.handoff.follow import follow_blocks
from workers.handoff.follower import Follower
from workers.handoff.reader import ReadOutcome
from workers.handoff.writer import write_blocks
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import BatchResult
from workers.pool.keys import block_keys, model_fingerprint

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 2, 2, 4, 8
CACHE_BLOCKS = 32
GROUP = 2  # --transfer-batch-blocks
NUM_KEYS = 9  # 8 full blocks and a partial one
POLL_S = 0.002
FINGERPRINT = model_fingerprint("follow-test", "float16", LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)


@dataclass
class Side:
    pool: KVPoolClient
    caches: list[np.ndarray]


def make_cache(seed: int | None) -> list[np.ndarray]:
    shape = (CACHE_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)  # [num_blocks, kv_heads, bs, dim]
    if seed is None:
        return [np.zeros(shape, np.float16) for _ in range(2 * LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(2 * LAYERS)]


def connect(addr, caches: list[np.ndarray]) -> KVPoolClient:
    config = PoolClientConfig(
        master_addr=addr.master_addr,
        metadata_url=addr.metadata_url,
        owner_addr=addr.owner_addr,
        num_slots=16,
        slot_bytes=describe_cache(caches).geometry.slot_bytes,
    )
    return KVPoolClient(config).connect()


@pytest.fixture(scope="module")
def sides(running_pool) -> Iterator[tuple[Side, Side]]:
    p_cache, d_cache = make_cache(7), make_cache(None)
    p, d = (
        Side(connect(running_pool, p_cache), p_cache),
        Side(connect(running_pool, d_cache), d_cache),
    )
    yield p, d
    p.pool.close()
    d.pool.close()


_salt = iter(range(1, 1_000_000))


def prompt_keys() -> list[str]:
    """Fresh keys per test (the pool outlives each test): 8 full blocks and a partial one."""
    salt = next(_salt)
    tokens = [(salt * 7919 + i * 31) % 32000 for i in range(8 * BLOCK_SIZE + 3)]
    keys = block_keys(FINGERPRINT, tokens, BLOCK_SIZE, namespace="follow")
    assert len(keys) == NUM_KEYS
    return keys


def same_block(p: Side, p_id: int, d: Side, d_id: int) -> bool:
    return all(np.array_equal(a[p_id], b[d_id]) for a, b in zip(p.caches, d.caches, strict=True))


P_IDS = list(range(NUM_KEYS))
D_IDS = [20, 3, 17, 9, 30, 1, 12, 25, 6]  # scattered, as D's allocator hands them out


def start_follow(pool, d: Side, keys, stop, deadline_s=None):
    run = ThreadPoolExecutor(1)
    future = run.submit(
        follow_blocks, pool, d.caches, keys, D_IDS, group_blocks=GROUP, wait_s=2.0,
        poll_s=POLL_S, stop=stop, deadline_s=deadline_s,
    )  # fmt: skip
    run.shutdown(wait=False)
    return future


def put(p: Side, keys: Sequence[str], ids: Sequence[int]) -> None:
    out = write_blocks(p.pool, p.caches, keys, ids, group_blocks=GROUP, wait_s=2.0)
    assert out.num_written == len(keys)


def test_follows_a_writer_thread_group_by_group_byte_exact(sides) -> None:
    p, d = sides
    keys = prompt_keys()
    stop = threading.Event()
    future = start_follow(d.pool, d, keys, stop)
    for start in range(0, NUM_KEYS - GROUP, GROUP):  # every group but the last one(s)
        put(p, keys[start : start + GROUP], P_IDS[start : start + GROUP])
        last = start + GROUP - 1
        # The follower copies what was put before the writer goes on: it reads behind P.
        wait_until(lambda last=last: same_block(p, last, d, D_IDS[last]), 10, f"block {last} read")
    assert not future.done()  # still waiting for the rest
    put(p, keys[8:], P_IDS[8:])
    out: ReadOutcome = future.result(timeout=10)
    assert (out.num_loaded, out.missing_keys) == (NUM_KEYS, ())
    assert all(same_block(p, P_IDS[i], d, D_IDS[i]) for i in range(NUM_KEYS))
    assert d.pool.slots.num_free == 16


def test_stop_ends_the_follow_with_what_it_read(sides) -> None:
    p, d = sides
    keys = prompt_keys()
    put(p, keys[:3], P_IDS[:3])
    stop = threading.Event()
    future = start_follow(d.pool, d, keys, stop)
    wait_until(lambda: same_block(p, 2, d, D_IDS[2]), 10, "block 2 read")
    t0 = time.monotonic()
    stop.set()
    out = future.result(timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert (out.num_loaded, out.missing_keys) == (3, tuple(keys[3:]))
    assert d.pool.slots.num_free == 16


def test_the_deadline_ends_the_follow(sides) -> None:
    _, d = sides
    keys = prompt_keys()
    t0 = time.monotonic()
    out = start_follow(d.pool, d, keys, threading.Event(), deadline_s=t0 + 0.2).result(10)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert (out.num_loaded, out.missing_keys) == (0, tuple(keys))


class Unfinished:
    """The reader's client, except that exists() already answers True for `early` keys: what
    a put in flight may look like. Their gets answer what the pool answers (not OK before
    the put), so nothing of them may be copied until the put has ended."""

    def __init__(self, pool: KVPoolClient, early: set[str]) -> None:
        self._pool, self.early = pool, early
        self.gets: list[tuple[str, ...]] = []

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [
            k in self.early or here for k, here in zip(keys, self._pool.exists(keys), strict=True)
        ]

    def get_into(self, keys, slots, staging=None) -> BatchResult:
        self.gets.append(tuple(keys))
        return self._pool.get_into(keys, slots, staging=staging)


def test_a_block_not_yet_complete_is_never_copied(sides) -> None:
    p, d = sides
    keys = prompt_keys()
    for i in range(NUM_KEYS):
        for cache in d.caches:
            cache[D_IDS[i]] = 0
    pool = Unfinished(d.pool, set(keys[2:4]))
    put(p, keys[:2], P_IDS[:2])
    stop = threading.Event()
    future = start_follow(pool, d, keys, stop)
    wait_until(lambda: sum(keys[2] in g for g in pool.gets) >= 3, 10, "3 gets of block 2")
    assert same_block(p, 1, d, D_IDS[1])
    assert all(not d.caches[0][D_IDS[i]].any() for i in (2, 3))  # asked for, never copied
    put(p, keys[2:], P_IDS[2:])
    out = future.result(timeout=10)
    assert (out.num_loaded, out.missing_keys) == (NUM_KEYS, ())
    assert all(same_block(p, P_IDS[i], d, D_IDS[i]) for i in range(NUM_KEYS))
    assert d.pool.slots.num_free == 16


class Counted(Unfinished):
    """The reader's client, recording each exists() batch."""

    def __init__(self, pool: KVPoolClient) -> None:
        super().__init__(pool, set())
        self.batches: list[tuple[str, ...]] = []

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.batches.append(tuple(keys))
        return super().exists(keys)


def test_one_follower_reads_every_request_with_one_poll_per_tick(sides) -> None:
    p, d = sides
    a, b = prompt_keys(), prompt_keys()
    a_ids, b_ids = D_IDS, [i + 1 for i in D_IDS]  # disjoint: 21, 4, 18, ...
    assert not set(a_ids) & set(b_ids)
    pool = Counted(d.pool)
    follower = Follower(lambda: pool, d.caches, group_blocks=GROUP, wait_s=2.0, poll_s=POLL_S)
    fa, fb = follower.add(a, a_ids, None), follower.add(b, b_ids, None)
    put(p, a[:4], P_IDS[:4])
    wait_until(lambda: fa.num_loaded == 4, 10, "a's first groups read")
    assert fb.num_loaded == 0 and not fa.done.done()
    assert any(set(batch) & set(a) and set(batch) & set(b) for batch in pool.batches)
    put(p, b, [9 + i for i in range(NUM_KEYS)])  # b's blocks from other P blocks
    put(p, a[4:], P_IDS[4:])
    out_a, out_b = fa.done.result(10), fb.done.result(10)
    assert (out_a.num_loaded, out_b.num_loaded) == (NUM_KEYS, NUM_KEYS)
    assert all(same_block(p, P_IDS[i], d, a_ids[i]) for i in range(NUM_KEYS))
    assert all(same_block(p, 9 + i, d, b_ids[i]) for i in range(NUM_KEYS))
    assert d.pool.slots.num_free == 16


def test_a_stopped_follow_ends_with_what_it_read_and_the_rest_go_on(sides) -> None:
    p, d = sides
    a, b = prompt_keys(), prompt_keys()
    follower = Follower(lambda: d.pool, d.caches, group_blocks=GROUP, wait_s=2.0, poll_s=1.0)
    fa, fb = follower.add(a, D_IDS, None), follower.add(b, [i + 1 for i in D_IDS], None)
    put(p, a[:2], P_IDS[:2])
    wait_until(lambda: fa.num_loaded == 2, 10, "a's first group read")
    t0 = time.monotonic()
    follower.stop(fa)
    out = fa.done.result(5)
    assert time.monotonic() - t0 < 0.5  # woken, not a poll interval later
    assert (out.num_loaded, out.missing_keys) == (2, tuple(a[2:]))
    assert not fb.done.done()
    follower.stop(fb)
    assert fb.done.result(5).num_loaded == 0


class Gated(Counted):
    """The reader's client, whose exists() waits for `go` (the follower's tick waits)."""

    def __init__(self, pool: KVPoolClient) -> None:
        super().__init__(pool)
        self.go, self.asked = threading.Event(), threading.Event()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked.set()
        assert self.go.wait(10)
        return super().exists(keys)


def test_the_follower_reads_the_most_urgent_follow_first_each_tick(sides) -> None:
    p, d = sides
    waiting, low, high = prompt_keys(), prompt_keys(), prompt_keys()
    put(p, low, P_IDS)
    put(p, high, P_IDS)
    pool = Gated(d.pool)
    follower = Follower(lambda: pool, d.caches, group_blocks=GROUP, wait_s=2.0, poll_s=POLL_S)
    fw = follower.add(waiting, [i + 2 for i in D_IDS], None)  # never written: its tick waits
    assert pool.asked.wait(10)
    fl = follower.add(low, D_IDS, None, priority=5)  # arrived first, less urgent
    fh = follower.add(high, [i + 1 for i in D_IDS], None, priority=-1)
    pool.go.set()
    assert (fh.done.result(10).num_loaded, fl.done.result(10).num_loaded) == (NUM_KEYS, NUM_KEYS)
    # One group of each per tick, the urgent one's first in every tick.
    owners = {k: "low" for k in low} | {k: "high" for k in high}
    assert [owners[keys[0]] for keys in pool.gets] == ["high", "low"] * 5
    follower.stop(fw)
    assert fw.done.result(5).num_loaded == 0
