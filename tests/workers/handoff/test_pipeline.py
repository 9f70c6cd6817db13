"""The handoff pipeline on the CPU (numpy caches, the CPU copy on its helper thread).

The pool here is a dict behind the client's two data calls, with the client's real staging
buffer and SlotAllocator: the fault and timing points the tests need (a put that waits for
the next copy, a get that fails) cannot be produced by a real pool on demand. The same
pipeline through a real master and owner: test_handoff_gpu.py (GPU) and the workers' e2e tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kernels.tensor_refs import bytes_per_slot
from tests.wait import wait_until
from workers.handoff import pipeline as handoff_pipeline
from workers.handoff.pipeline import get_blocks, put_blocks
from workers.pool.errors import BatchResult
from workers.pool.staging import SlotAllocator, StagingBuffer

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, DIM = 2, 24, 2, 4, 8
MISSING_CODE = -704
WAIT_S = 10.0


def make_cache(seed: int | None) -> list[np.ndarray]:
    """[K0, V0, K1, V1], each [num_blocks, heads, block_size, dim]; random, or zeros."""
    rng = np.random.default_rng(seed)
    shape = (BLOCKS, HEADS, BLOCK_SIZE, DIM)
    if seed is None:
        return [np.zeros(shape, np.uint16) for _ in range(2 * LAYERS)]
    return [rng.integers(0, 65535, shape, dtype=np.uint16) for _ in range(2 * LAYERS)]


class RecordingSlots(SlotAllocator):
    """The real allocator, remembering what each allocate() handed out."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.allocations: list[list[int]] = []

    def allocate(self, num_slots: int) -> list[int] | None:
        slots = super().allocate(num_slots)
        if slots is not None:
            self.allocations.append(slots)
        return slots

    def allocate_within(self, num_slots: int, timeout_s: float) -> list[int] | None:
        slots = super().allocate_within(num_slots, timeout_s)
        if slots is not None:
            self.allocations.append(slots)
        return slots


class DictPool:
    """put_from / get_into over a dict, with hooks called before each call's copy."""

    headers_later = None  # no optional capability (workers/handoff/slots.py HandoffPool)
    sharded = None

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.buffer = StagingBuffer(num_slots, slot_bytes)
        self.slots = RecordingSlots(num_slots)
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.before_put: Callable[[int, list[int]], None] = lambda i, slots: None
        self.before_get: Callable[[int, list[int]], None] = lambda i, slots: None

    def put_from(self, keys: list[str], slots: list[int], staging: object = None) -> BatchResult:
        self.before_put(sum(op == "put" for op, _ in self.calls), list(slots))
        self.calls.append(("put", list(keys)))
        for key, slot in zip(keys, slots, strict=True):
            self.objects[key] = self.buffer.slot(slot).tobytes()
        return BatchResult.from_codes(keys, [0] * len(keys))

    def get_into(self, keys: list[str], slots: list[int], staging: object = None) -> BatchResult:
        self.before_get(sum(op == "get" for op, _ in self.calls), list(slots))
        self.calls.append(("get", list(keys)))
        codes = []
        for key, slot in zip(keys, slots, strict=True):
            value = self.objects.get(key)
            if value is None:
                codes.append(MISSING_CODE)
            else:
                self.buffer.slot(slot)[:] = np.frombuffer(value, np.uint8)
                codes.append(len(value))
        return BatchResult.from_codes(keys, codes)

    def assert_all_free(self) -> None:
        self.slots.check_integrity()
        assert self.slots.num_free == self.slots.num_slots


def at_once() -> float:
    """A slot bound already reached: the slots a call takes must be free at once (else the
    pipeline raises 503 staging_full), so no test waits on its own staging."""
    return time.monotonic()


def blocks_equal(a: list[np.ndarray], a_ids: list[int], b: list[np.ndarray], b_ids: list[int]):
    return all(np.array_equal(x[a_ids], y[b_ids]) for x, y in zip(a, b, strict=True))


P_IDS = [17, 3, 22, 9, 0, 14, 5, 20, 11, 1]  # scattered; 10 blocks = groups of 4, 4, 2
D_IDS = [2, 19, 7, 12, 23, 4, 15, 8, 21, 6]
KEYS = [f"k{i}" for i in range(len(P_IDS))]


@pytest.fixture
def pool() -> DictPool:
    return DictPool(num_slots=8, slot_bytes=bytes_per_slot(make_cache(None)))


@pytest.mark.parametrize("overlap", [True, False])
def test_round_trip_is_byte_exact_and_frees_every_slot(pool: DictPool, overlap: bool) -> None:
    src, dst = make_cache(1), make_cache(None)
    put = put_blocks(pool, src, P_IDS, KEYS, 4, at_once(), overlap=overlap)
    results = put.results
    assert [r.keys for r in results] == [tuple(KEYS[:4]), tuple(KEYS[4:8]), tuple(KEYS[8:])]
    assert all(r.ok for r in results)
    assert put.timings.d2h_s > 0 and put.timings.put_s > 0
    outcome = get_blocks(pool, dst, D_IDS, KEYS, 4, at_once(), overlap)
    assert outcome.num_loaded == len(KEYS) and outcome.missing_keys == ()
    assert blocks_equal(src, P_IDS, dst, D_IDS)
    untouched = sorted(set(range(BLOCKS)) - set(D_IDS))
    assert all(not t[untouched].any() for t in dst)
    assert outcome.timings.get_s > 0 and outcome.timings.h2d_s > 0
    pool.assert_all_free()


def test_put_overlaps_the_next_copy(pool: DictPool) -> None:
    """The put of group 0 waits until the D2H of group 1 has landed in its slots: the two ran
    at the same time (one group at a time, this put would wait in vain)."""
    src = make_cache(2)
    seen: list[bool] = []

    def before_put(index: int, slots: list[int]) -> None:
        if index == 0:
            expected = [pool_bytes(src, block_id) for block_id in P_IDS[4:8]]

            def landed() -> bool:
                allocations = pool.slots.allocations
                got = [pool.buffer.slot(s).tobytes() for s in allocations[-1]]
                return len(allocations) > 1 and got == expected

            seen.append(wait_for(landed))

    pool.before_put = before_put
    put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
    assert seen == [True]
    pool.assert_all_free()


def test_get_overlaps_the_previous_copy(pool: DictPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The H2D copy of group 0 waits until the get of group 1 has begun: the two ran at the
    same time (one group at a time, this copy would wait in vain)."""
    src, dst = make_cache(3), make_cache(None)
    put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
    second_get = threading.Event()
    seen: list[bool] = []
    real_swap = handoff_pipeline.swap_cache_layout

    def watched_swap(*args: object, **kwargs: object) -> object:
        if not seen:
            seen.append(second_get.wait(WAIT_S))
        return real_swap(*args, **kwargs)

    monkeypatch.setattr(handoff_pipeline, "swap_cache_layout", watched_swap)
    pool.before_get = lambda index, slots: second_get.set() if index == 1 else None
    outcome = get_blocks(pool, dst, D_IDS, KEYS, 4, at_once())
    assert seen == [True] and outcome.num_loaded == len(KEYS)
    assert blocks_equal(src, P_IDS, dst, D_IDS)
    pool.assert_all_free()


def test_get_stops_at_the_first_miss(pool: DictPool) -> None:
    src, dst = make_cache(4), make_cache(None)
    put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
    del pool.objects["k6"]
    del pool.objects["k9"]
    pool.calls.clear()
    outcome = get_blocks(pool, dst, D_IDS, KEYS, 4, at_once())
    assert outcome.num_loaded == 6 and outcome.missing_keys == ("k6",)
    assert pool.calls == [("get", KEYS[:4]), ("get", KEYS[4:8])]  # no get past the miss
    assert blocks_equal(src, P_IDS[:6], dst, D_IDS[:6])
    assert all(not t[D_IDS[6:]].any() for t in dst)
    pool.assert_all_free()


@pytest.mark.parametrize("overlap", [True, False])
def test_get_starts_no_group_after_its_stop_time(pool: DictPool, overlap: bool) -> None:
    """A bounded load (the pool prefix read's time bound): the group whose get would start
    past stop_at_s and every later one count as missing; what was read is whole."""
    src, dst = make_cache(6), make_cache(None)
    put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
    pool.calls.clear()
    stop_at_s = time.monotonic() + 1.0
    # The second group's get lasts until the bound has passed: the third must not start.
    pool.before_get = lambda index, slots: (
        wait_until(lambda: time.monotonic() > stop_at_s, 5, "the stop time") if index == 1 else None
    )
    outcome = get_blocks(pool, dst, D_IDS, KEYS, 4, at_once(), overlap=overlap, stop_at_s=stop_at_s)
    assert outcome.num_loaded == 8 and outcome.missing_keys == tuple(KEYS[8:])
    assert pool.calls == [("get", KEYS[:4]), ("get", KEYS[4:8])]
    assert blocks_equal(src, P_IDS[:8], dst, D_IDS[:8])
    assert all(not t[D_IDS[8:]].any() for t in dst)
    pool.assert_all_free()
    # A bound already past: nothing is read.
    late = get_blocks(pool, dst, D_IDS, KEYS, 4, at_once(), stop_at_s=time.monotonic())
    assert late.num_loaded == 0 and late.missing_keys == tuple(KEYS)
    pool.assert_all_free()


def test_staging_for_one_group_only_runs_serialized(pool: DictPool) -> None:
    """Slots for one group: no overlap is possible, and nothing waits on itself."""
    small = DictPool(num_slots=4, slot_bytes=pool.buffer.slot_bytes)
    src, dst = make_cache(5), make_cache(None)
    assert all(r.ok for r in put_blocks(small, src, P_IDS, KEYS, 4, at_once()).results)
    assert get_blocks(small, dst, D_IDS, KEYS, 4, at_once()).num_loaded == len(KEYS)
    assert blocks_equal(src, P_IDS, dst, D_IDS)
    small.assert_all_free()


@pytest.mark.parametrize("side", ["put", "get"])
def test_an_error_waits_for_the_copy_in_flight(
    pool: DictPool, side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool call fails while a copy is in flight: the caller gets the error only after
    that copy completed, so it can never free blocks the copy still reads or writes."""
    src, dst = make_cache(6), make_cache(None)
    if side == "get":
        put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
    call_failed, returned = threading.Event(), threading.Event()
    copy_saw_return: list[bool] = []
    real_swap = handoff_pipeline.swap_cache_layout
    copies = 0

    def slow_swap(*args: object, **kwargs: object) -> object:
        nonlocal copies
        copies += 1
        if copies == 2 if side == "put" else copies == 1:  # the copy that overlaps the call
            assert call_failed.wait(WAIT_S)
            # If the pipeline did not wait for this copy, its caller returns now.
            copy_saw_return.append(returned.wait(1.0))
        return real_swap(*args, **kwargs)

    def fail(index: int, slots: list[int]) -> None:
        if index == (0 if side == "put" else 1):
            call_failed.set()
            raise RuntimeError("pool call failed")

    monkeypatch.setattr(handoff_pipeline, "swap_cache_layout", slow_swap)
    pool.before_put, pool.before_get = (fail, pool.before_get) if side == "put" else (
        pool.before_put, fail)  # fmt: skip
    with pytest.raises(RuntimeError, match="pool call failed"):
        try:
            if side == "put":
                put_blocks(pool, src, P_IDS, KEYS, 4, at_once())
            else:
                get_blocks(pool, dst, D_IDS, KEYS, 4, at_once())
        finally:
            returned.set()
    assert copy_saw_return == [False]
    pool.assert_all_free()


def pool_bytes(cache: list[np.ndarray], block_id: int) -> bytes:
    """The staging bytes of one block: [layers, 2, heads, block_size, dim], block-major."""
    return np.stack([t[block_id] for t in cache]).tobytes()


def wait_for(cond: Callable[[], bool]) -> bool:
    """True once cond holds (polled, bounded), False past WAIT_S."""
    try:
        return wait_until(cond, WAIT_S, "the overlapping stage")
    except AssertionError:
        return False
