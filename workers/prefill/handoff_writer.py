"""The prefill side of the handoff: a request's KV blocks out of the engine and into the pool.

    exists(keys)                    the blocks the pool already holds are skipped
    for each batch of the rest:     swap_cache_layout device -> host into staging slots
                                    put_from(keys, slots)
                                    slots freed (they stay pinned while a put still runs)

Runs in a thread (the copies and the pool calls block); the caller keeps the engine's blocks
until it returns.
"""

from __future__ import annotations

import logging
import time

from workers.server.pd_worker import PDContext

log = logging.getLogger(__name__)


def write_blocks(
    ctx: PDContext, keys: list[str], block_ids: list[int], timings: dict[str, float]
) -> tuple[int, int, int]:
    """Put the blocks whose keys the pool lacks; (written, skipped, bytes). Runs in a thread."""
    from kernels.swap_cache_layout import swap_cache_layout
    from workers.pool.errors import PoolError

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
    written = num_bytes = 0
    batch = ctx.settings.transfer_batch_blocks
    for start in range(0, len(todo), batch):
        group = todo[start : start + batch]
        slots = ctx.wait_for_slots(len(group), deadline_s)
        try:
            t0 = time.monotonic()
            swap_cache_layout(
                ctx.engine.kv_caches, pool.buffer.view, [block_ids[i] for i in group], slots, 0
            ).wait()
            t1 = time.monotonic()
            result = pool.put_from([keys[i] for i in group], slots)
            timings["d2h_s"] += t1 - t0
            timings["put_s"] += time.monotonic() - t1
        finally:
            pool.slots.free(slots)
        written += len(result.ok_keys)
        num_bytes += len(result.ok_keys) * pool.config.slot_bytes
        if not result.ok:
            log.warning("pool put failed for %d keys: %s", len(result.failed_keys), result.error())
    return written, len(keys) - len(todo), num_bytes
