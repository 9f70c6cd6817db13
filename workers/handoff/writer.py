"""The prefill side of the handoff: a request's KV blocks out of the engine and into the pool.

    exists(keys)                    the blocks the pool already holds are skipped
    the rest, group by group:       swap_cache_layout device -> host into staging slots,
                                    put_from(keys, slots); the copy of group i+1 runs while
                                    group i is put (workers/handoff/pipeline.py)
                                    slots freed (they stay pinned while a put still runs)

write_blocks runs in a thread (the copies and the pool calls block); the caller keeps the
engine's blocks until it returns, and it returns only once every copy it started has completed.
ChunkedWrite runs its parts on the handoff threads by the request's priority
(workers/handoff/priority_threads.py): an urgent request's parts go before the queued parts of
less urgent ones.

ChunkedWrite writes one request's blocks part by part as the engine reports them computed: the
blocks of a finished prefill chunk go out while the next chunk computes, so when the prefill
ends only the last chunk's blocks remain (the engine pins reported blocks until release):

    engine   chunk 0 | chunk 1         | chunk 2 (samples)  |
    writer           | write blocks 0  | write blocks 1     | write the rest | answer
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.handoff.pipeline import put_blocks
from workers.handoff.priority_threads import handoff_threads
from workers.handoff.slots import HandoffPool
from workers.handoff.tasks import wait_to_end
from workers.handoff.timings import WriteTimings
from workers.pool.errors import PoolDegradedError, PoolError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOutcome:
    """Blocks put, blocks the pool already held, bytes put, and what the write waited on."""

    num_written: int = 0
    num_skipped: int = 0
    num_bytes: int = 0
    timings: WriteTimings = field(default_factory=WriteTimings)

    def __add__(self, other: WriteOutcome) -> WriteOutcome:
        return WriteOutcome(
            self.num_written + other.num_written,
            self.num_skipped + other.num_skipped,
            self.num_bytes + other.num_bytes,
            self.timings + other.timings,
        )


def write_blocks(
    pool: HandoffPool,
    kv_caches: Sequence[object],
    keys: Sequence[str],
    block_ids: Sequence[int],
    *,
    group_blocks: int,
    wait_s: float,
    pipelined: bool = True,
) -> WriteOutcome:
    """Put the blocks whose keys the pool lacks (block_ids[i] under keys[i]). Runs in a
    thread. group_blocks blocks per copy and pool call; staging slots are waited for up to
    wait_s (then 503 staging_full); pipelined=False moves one group at a time (the
    serialized baseline)."""
    deadline_s = time.monotonic() + wait_s
    t0 = time.monotonic()
    try:
        present = pool.exists(keys)
    except PoolDegradedError:
        # The client is reconnecting (it said so once, and /health says why): no copy, no
        # put; D recomputes what it cannot read.
        return WriteOutcome(timings=WriteTimings(put_s=time.monotonic() - t0))
    except PoolError as exc:
        log.warning("pool exists() failed (%s); writing every block", exc)
        present = [False] * len(keys)
    exists_s = time.monotonic() - t0
    todo = [i for i, here in enumerate(present) if not here]
    outcome = put_blocks(
        pool,
        kv_caches,
        [block_ids[i] for i in todo],
        [keys[i] for i in todo],
        group_blocks,
        deadline_s,
        overlap=pipelined,
    )
    written = sum(len(r.ok_keys) for r in outcome.results)
    for result in outcome.results:
        if not result.ok:
            log.warning("pool put failed for %d keys: %s", len(result.failed_keys), result.error())
    return WriteOutcome(
        written,
        len(keys) - len(todo),
        written * pool.config.slot_bytes,
        outcome.timings + WriteTimings(put_s=exists_s),
    )


class ChunkedWrite:
    """One request's prompt blocks written in parts, in order, each on a handoff thread by
    priority (the request's: lower goes first).

    add(first, block_ids) starts writing blocks [first, first + len) under keys[first:...] once
    the parts before it are done, and returns at once; finish() waits for every part, also
    when the caller is cancelled (the copies read the engine's blocks: the caller releases
    them only after), and returns the WriteOutcome of all parts or raises the first part's
    error (the parts after a failed one are not started).
    """

    def __init__(
        self,
        pool: HandoffPool,
        kv_caches: Sequence[object],
        keys: Sequence[str],
        *,
        group_blocks: int,
        wait_s: float,
        priority: int = 0,
    ) -> None:
        self._pool, self._kv_caches, self._keys = pool, kv_caches, list(keys)
        self._group_blocks, self._wait_s = group_blocks, wait_s
        self._priority = priority
        self.next_block = 0  # blocks [0, next_block) are handed over
        self._outcome = WriteOutcome()
        self._last: asyncio.Future[None] | None = None

    def add(self, first: int, block_ids: Sequence[int]) -> None:
        if first != self.next_block or first + len(block_ids) > len(self._keys):
            raise ValueError(
                f"blocks [{first}, {first + len(block_ids)}) do not follow [0, "
                f"{self.next_block}) within the {len(self._keys)} keys"
            )
        if not block_ids:
            return
        self.next_block = first + len(block_ids)
        self._last = asyncio.ensure_future(self._write(self._last, first, list(block_ids)))

    async def _write(self, before: asyncio.Future[None] | None, first: int, ids: list[int]) -> None:
        if before is not None:
            await before  # raises the earlier part's error: this part is not written
        part = await handoff_threads().run(
            self._priority,
            write_blocks,
            self._pool,
            self._kv_caches,
            self._keys[first : first + len(ids)],
            ids,
            group_blocks=self._group_blocks,
            wait_s=self._wait_s,
        )
        self._outcome = self._outcome + part

    async def finish(self) -> WriteOutcome:
        """Every part's outcome once all have ended; raises a part's error."""
        if self._last is not None:  # the copies end before the caller frees the blocks
            await wait_to_end(self._last)
        return self._outcome
