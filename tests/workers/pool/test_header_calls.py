"""Header calls (workers/pool/header_calls.py): a batch split over concurrent calls, and a
request's header puts left running behind its next groups, with their slots held and their
codes folded into the payload puts' results. A stand-in client (the calls' logic; the real
pool runs them in tests/workers/pool/test_checked_pool.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from tests.workers.handoff.fake_pool import FakePool, kv_views
from workers.handoff.pipeline import put_blocks
from workers.pool.checked_pool import CheckedPool
from workers.pool.errors import BatchResult
from workers.pool.header_calls import HEADER_CALLS, HeaderCalls, parts
from workers.pool.keys import block_keys, header_key
from workers.pool.object_header import HEADER_BYTES
from workers.pool.staging import SlotAllocator

WAIT_S = 10.0
BLOCK_SIZE = 4


class Client:
    """Answers header calls with codes by key, once `release` is set; records each call."""

    buffer = object()  # the host staging the calls name

    def __init__(self, codes: dict[str, int]) -> None:
        self.codes, self.calls = codes, []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def _answer(self, keys: Sequence[str], slots: Sequence[int], ok: int) -> BatchResult:
        assert self.release.wait(WAIT_S)
        with self.lock:
            self.calls.append((tuple(keys), tuple(slots)))
        return BatchResult(tuple(keys), tuple(self.codes.get(k, ok) for k in keys))

    def put_from(self, keys, slots, sizes, staging, headers=False) -> BatchResult:
        assert headers and staging is self.buffer and set(sizes) == {HEADER_BYTES}
        return self._answer(keys, slots, 0)

    def get_into(self, keys, slots, staging, headers=False) -> BatchResult:
        assert headers and staging is self.buffer
        return self._answer(keys, slots, HEADER_BYTES)


@pytest.fixture
def calls() -> Iterator[tuple[HeaderCalls, Client]]:
    client = Client({"h5": -800})
    header_calls = HeaderCalls(client)
    yield header_calls, client
    client.release.set()
    header_calls.close()


def test_a_batch_is_split_in_order_over_concurrent_calls(
    calls: tuple[HeaderCalls, Client],
) -> None:
    header_calls, client = calls
    keys = [f"h{i}" for i in range(10)]
    started = header_calls.start("get", keys, list(range(10, 20)), pin=None)
    assert len(started) == HEADER_CALLS
    client.release.set()
    result = header_calls.join(started)
    assert result.keys == tuple(keys)
    assert result.codes == tuple(-800 if k == "h5" else HEADER_BYTES for k in keys)
    assert sorted(client.calls) == [
        (("h0", "h1", "h2"), (10, 11, 12)),
        (("h3", "h4", "h5"), (13, 14, 15)),
        (("h6", "h7", "h8"), (16, 17, 18)),
        (("h9",), (19,)),
    ]
    assert [list(p) for p in parts(2, 4)] == [[0], [1]] and parts(0, 4) == []


def test_a_late_header_put_holds_its_slots_and_settle_folds_its_codes(
    calls: tuple[HeaderCalls, Client],
) -> None:
    header_calls, client = calls
    alloc = SlotAllocator(8)
    slots = alloc.allocate(6)
    assert slots is not None
    payload = BatchResult(tuple(f"k{i}" for i in range(6)), (0, 0, -706, 0, 0, 0))
    done = [0, 1, 3, 4, 5]  # the blocks whose payload put was OK
    with header_calls.later() as late:
        assert header_calls.late is late
        started = header_calls.start("put", [f"h{i}" for i in done], [slots[i] for i in done],
                                     pin=alloc)  # fmt: skip
        late.pending.append((payload, done, started))
        alloc.free(slots)  # what the pipeline does once put_from returned
        assert alloc.num_free == 2 + 1  # slot of the failed payload: no header call reads it
        client.release.set()
        (settled,) = late.settle([payload])
    assert header_calls.late is None and late.pending == []
    assert settled.codes == (0, 0, -706, 0, 0, -800)  # h5's header put failed: k5 is not in
    assert alloc.num_free == 8
    alloc.check_integrity()


def test_leaving_later_on_an_error_waits_for_the_calls_still_running(
    calls: tuple[HeaderCalls, Client],
) -> None:
    header_calls, client = calls
    alloc = SlotAllocator(4)
    slots = alloc.allocate(4)
    assert slots is not None
    with pytest.raises(RuntimeError), header_calls.later() as late:
        started = header_calls.start("put", ["a", "b", "c", "d"], slots, pin=alloc)
        late.pending.append((BatchResult(("a", "b", "c", "d"), (0,) * 4), [0, 1, 2, 3], started))
        alloc.free(slots)
        threading.Timer(0.05, client.release.set).start()
        raise RuntimeError("a copy failed")
    assert all(call.done() for call in started) and alloc.num_free == 4


class RecordingPool(FakePool):
    """The fault pool taking header puts too, recording the order of every put."""

    def __init__(self, fail_headers: set[str]) -> None:
        super().__init__(BLOCK_SIZE, num_slots=8)
        self.order: list[tuple[str, str]] = []  # ("payload" | "header", key), in put order
        self.fail_headers = fail_headers
        self.lock = threading.Lock()

    def put_from(self, keys, slots, sizes=None, staging=None, headers=False) -> BatchResult:  # type: ignore[override]
        with self.lock:
            self.order += [("header" if headers else "payload", k) for k in keys]
        if not headers:
            return super().put_from(keys, slots, staging)
        for key, slot in zip(keys, slots, strict=True):
            self.store[key] = self.buffer.headers[slot].tobytes()
        return BatchResult.from_codes(keys, [-800 if k in self.fail_headers else 0 for k in keys])


def test_put_blocks_puts_headers_after_their_payloads_and_all_before_it_returns() -> None:
    keys = block_keys("00112233aabbccdd", list(range(12 * BLOCK_SIZE)), BLOCK_SIZE)
    pool = RecordingPool(fail_headers={header_key(keys[5])})
    checked = CheckedPool(pool, BLOCK_SIZE)
    cache = np.arange(16 * BLOCK_SIZE, dtype=np.int64).reshape(16, BLOCK_SIZE)
    slots_by_s = time.monotonic() + WAIT_S
    outcome = put_blocks(checked, kv_views(cache), list(range(12)), keys, 4, slots_by_s)
    codes = [c for result in outcome.results for c in result.codes]
    assert codes == [0] * 5 + [-800] + [0] * 6  # the failed header put fails its key
    where = {entry: i for i, entry in enumerate(pool.order)}
    assert all(where[("header", header_key(k))] > where[("payload", k)] for k in keys)
    assert all(header_key(k) in pool.store for k in keys)  # every header in on return
    assert pool.slots.num_free == 8
    pool.slots.check_integrity()
