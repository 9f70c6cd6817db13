"""The pool calls that move blocks' header objects (workers/pool/checked_pool.py).

Two things keep them off a handoff's critical path:

- A batch of headers is split over HEADER_CALLS concurrent Mooncake calls (the owner pays
  per key, as for payloads: workers/pool/device_pool.py splits those the same way), each a
  host call from the host staging's header bytes.
- Inside `later()` (workers/handoff/pipeline.py put_blocks runs a request's groups in it) a
  group's header put is started and not waited for: it runs while the next group's copy
  and payload put do, and settle() waits for all of them before the request's puts count
  as done. The order that makes a header mean "payload complete" is kept: a header put
  starts only after its payload put returned OK. Its slots stay pinned until it returned
  (SlotAllocator: the pipeline's free waits), so no later group writes into header bytes a
  call still reads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.pool.errors import BatchResult
from workers.pool.object_header import HEADER_BYTES
from workers.pool.staging import SlotAllocator

HEADER_CALLS = 4  # concurrent calls one batch of headers is split over
HEADER_THREADS = 16  # header calls of concurrent requests (a get's run beside its payload get)

Calls = list[concurrent.futures.Future]  # one per part of a batch, in order


@dataclass
class LateHeaders:
    """The header puts one request started and has not waited for: per group, the result of
    its payload put, the indexes of the blocks whose headers were put, and their calls."""

    pending: list[tuple[BatchResult, list[int], Calls]] = field(default_factory=list)

    def settle(self, results: Sequence[BatchResult]) -> list[BatchResult]:
        """results (the payload puts' BatchResults) with each block's header put folded in:
        a key is OK when its payload and its header are."""
        merged = {id(r): (done, _join(calls)) for r, done, calls in self.pending}
        self.pending.clear()
        out = []
        for result in results:
            if id(result) in merged:
                result = fold(result, *merged[id(result)])
            out.append(result)
        return out

    def wait(self) -> None:
        """Wait for every call still running, whatever it answers (an error path's end)."""
        for _, _, calls in self.pending:
            concurrent.futures.wait(calls)
        self.pending.clear()


class HeaderCalls:
    """Header puts and gets through the client's host staging header bytes."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._threads = concurrent.futures.ThreadPoolExecutor(HEADER_THREADS, "pool-headers")
        self._local = threading.local()  # .late: this thread's LateHeaders, inside later()

    @property
    def late(self) -> LateHeaders | None:
        return getattr(self._local, "late", None)

    @contextlib.contextmanager
    def later(self) -> Iterator[LateHeaders]:
        """Header puts made on this thread inside the block are not waited for (settle())."""
        late = LateHeaders()
        self._local.late = late
        try:
            yield late
        finally:
            self._local.late = None
            late.wait()

    def start(
        self,
        op: str,
        keys: Sequence[str],
        slots: Sequence[int],
        pin: SlotAllocator | None,
        calls: int = HEADER_CALLS,
    ) -> Calls:
        """Start the header put or get of keys from/into the header bytes of slots, split
        over `calls` calls; with pin, each part's slots stay pinned while it runs."""
        method = self._client.put_from if op == "put" else self._client.get_into
        host = self._client.buffer
        started = []
        for part in parts(len(keys), calls):
            part_keys, part_slots = [keys[i] for i in part], tuple(slots[i] for i in part)
            sizes = ([HEADER_BYTES] * len(part),) if op == "put" else ()
            args = (part_keys, part_slots, *sizes, host)
            if pin is not None:
                pin.pin(part_slots)
            started.append(self._threads.submit(_call, method, args, pin, part_slots))
        return started

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """fn(*args) on these threads (what runs beside a payload call)."""
        return self._threads.submit(fn, *args)

    @staticmethod
    def join(calls: Calls) -> BatchResult:
        """The result of a batch start() began (waits for its calls)."""
        return _join(calls)

    def close(self) -> None:
        self._threads.shutdown(wait=True)


def fold(result: BatchResult, done: list[int], headers: BatchResult) -> BatchResult:
    """The payload put's result with the header put's code of each block in done."""
    codes = list(result.codes)
    for i, code in zip(done, headers.codes, strict=True):
        codes[i] = min(code, 0)
    return BatchResult.from_codes(list(result.keys), codes)


def _call(method: Any, args: tuple, pin: SlotAllocator | None, slots: tuple[int, ...]) -> Any:
    try:
        return method(*args, headers=True)
    finally:
        if pin is not None:
            pin.unpin(slots)


def _join(calls: Calls) -> BatchResult:
    """One BatchResult of a batch's parts, in order (a part that raised raises here)."""
    keys: list[str] = []
    codes: list[int] = []
    for call in calls:
        part = call.result()
        keys += part.keys
        codes += part.codes
    return BatchResult(tuple(keys), tuple(codes))


def parts(n: int, parts: int) -> list[range]:
    """n indexes cut into at most `parts` runs of near-equal length."""
    size = -(-n // parts) if n else 1
    return [range(start, min(start + size, n)) for start in range(0, n, size)]
