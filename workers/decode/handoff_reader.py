"""The decode side of the handoff: a request's KV blocks out of the pool into the engine.

    for each batch of keys:   get_into(keys, slots)
                              swap_cache_layout host -> device for the blocks read, in order,
                              up to the first one the pool lacked
    stop at the first miss:   the engine recomputes from there (policy `recompute`), or the
                              request fails naming the keys (policy `fail`)

Runs in a thread; the blocks it fills belong to the request, which is not added to the engine
before this returns.
"""

from __future__ import annotations

import logging
import time

from workers.server.pd_worker import PDContext

log = logging.getLogger(__name__)


def load_blocks(
    ctx: PDContext,
    keys: list[str],
    block_ids: list[int],
    timings: dict[str, float],
    deadline_s: float | None = None,
) -> tuple[int, list[str], int]:
    """Read keys into block_ids up to the first miss: (blocks loaded, missing keys, bytes).

    missing keys are those of the batch where reading stopped that the pool did not return.
    With deadline_s (monotonic), no batch starts after it: the keys left count as missing.
    Runs in a thread.
    """
    from kernels.swap_cache_layout import swap_cache_layout
    from workers.pool.errors import KeyStatus, PoolError

    pool = ctx.require_pool()
    deadline_s = time.monotonic() + ctx.settings.wait_s
    loaded = num_bytes = 0
    batch = ctx.settings.transfer_batch_blocks
    for start in range(0, len(keys), batch):
        if deadline_s is not None and time.monotonic() >= deadline_s:
            return loaded, keys[start:], num_bytes
        group_keys = keys[start : start + batch]
        slots = ctx.wait_for_slots(len(group_keys), deadline_s)
        try:
            t0 = time.monotonic()
            try:
                statuses = list(pool.get_into(group_keys, slots).statuses)
            except PoolError as exc:
                log.warning("pool get failed (%s): treating %d keys as missing", exc, len(keys))
                statuses = [KeyStatus.ERROR] * len(group_keys)
            t1 = time.monotonic()
            num_ok = next(
                (i for i, s in enumerate(statuses) if s is not KeyStatus.OK), len(statuses)
            )
            if num_ok:
                swap_cache_layout(
                    ctx.engine.kv_caches,
                    pool.buffer.view,
                    block_ids[start : start + num_ok],
                    slots[:num_ok],
                    1,
                ).wait()
            timings["get_s"] += t1 - t0
            timings["h2d_s"] += time.monotonic() - t1
        finally:
            pool.slots.free(slots)
        loaded += num_ok
        num_bytes += num_ok * pool.config.slot_bytes
        if num_ok < len(group_keys):
            missing = [
                k for k, s in zip(group_keys, statuses, strict=True) if s is not KeyStatus.OK
            ]
            return loaded, missing, num_bytes
    return loaded, [], num_bytes
