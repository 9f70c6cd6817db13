"""The prefill side of the handoff: a request's KV blocks out of the engine and into the pool.

    exists(keys)                    the blocks the pool already holds are skipped
    the rest, group by group:       swap_cache_layout device -> host into staging slots,
                                    put_from(keys, slots); the copy of group i+1 runs while
                                    group i is put (workers/pool/handoff_pipeline.py)
                                    slots freed (they stay pinned while a put still runs)

write_blocks runs in a thread (the copies and the pool calls block); the caller keeps the
engine's blocks until it returns, and it returns only once every copy it started has completed.

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
from typing import TYPE_CHECKING

from workers.server.tasks import wait_to_end

if TYPE_CHECKING:
    from workers.server.pd_worker import PDContext

log = logging.getLogger(__name__)


def write_blocks(
    ctx: PDContext,
    keys: list[str],
    block_ids: list[int],
    timings: dict[str, float],
    *,
    pipelined: bool = True,
) -> tuple[int, int, int]:
    """Put the blocks whose keys the pool lacks; (written, skipped, bytes). Runs in a thread.

    timings gets d2h_s and put_s added (with pipelined, the time spent waiting on each stage);
    pipelined=False moves one group at a time (the serialized baseline).
    """
    from workers.pool.errors import PoolError
    from workers.pool.handoff_pipeline import put_blocks

    pool = ctx.require_pool()
    deadline_s = time.monotonic() + ctx.settings.wait_s
    t0 = time.monotonic()
    try:
        present = pool.exists(keys)
    except PoolError as exc:
        log.warning("pool exists() failed (%s); writing every block", exc)
        present = [False] * len(keys)
    timings["put_s"] += time.monotonic() - t0
    todo = [i for i, here in enumerate(present) if not here]
    stages: dict[str, float] = {}
    results = put_blocks(
        pool,
        ctx.engine.kv_caches,
        [block_ids[i] for i in todo],
        [keys[i] for i in todo],
        ctx.settings.transfer_batch_blocks,
        lambda n: ctx.wait_for_slots(n, deadline_s),
        stages,
        overlap=pipelined,
    )
    timings["d2h_s"] += stages.get("copy_s", 0.0)
    timings["put_s"] += stages.get("pool_s", 0.0)
    written = sum(len(r.ok_keys) for r in results)
    for result in results:
        if not result.ok:
            log.warning("pool put failed for %d keys: %s", len(result.failed_keys), result.error())
    return written, len(keys) - len(todo), written * pool.config.slot_bytes


class ChunkedWrite:
    """One request's prompt blocks written in parts, in order, each in a worker thread.

    add(first, block_ids) starts writing blocks [first, first + len) under keys[first:...] once
    the parts before it are done, and returns at once; finish() waits for every part, also
    when the caller is cancelled (the copies read the engine's blocks: the caller releases
    them only after), and returns (written, skipped, bytes) or raises the first part's error
    (the parts after a failed one are not started).
    """

    def __init__(self, ctx: PDContext, keys: Sequence[str]) -> None:
        self._ctx, self._keys = ctx, list(keys)
        self.timings = {"d2h_s": 0.0, "put_s": 0.0}
        self.next_block = 0  # blocks [0, next_block) are handed over
        self._written = self._skipped = self._bytes = 0
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
        keys = self._keys[first : first + len(ids)]
        written, skipped, num_bytes = await asyncio.to_thread(
            write_blocks, self._ctx, keys, ids, self.timings
        )
        self._written += written
        self._skipped += skipped
        self._bytes += num_bytes

    async def finish(self) -> tuple[int, int, int]:
        """(written, skipped, bytes) once every part has ended; raises a part's error."""
        if self._last is not None:  # the copies end before the caller frees the blocks
            await wait_to_end(self._last)
        return self._written, self._skipped, self._bytes
