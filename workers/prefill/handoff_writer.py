"""The prefill side of the handoff: a request's KV blocks out of the engine and into the pool.

    exists(keys)                    the blocks the pool already holds are skipped
    the rest, group by group:       swap_cache_layout device -> host into staging slots,
                                    put_from(keys, slots); the copy of group i+1 runs while
                                    group i is put (workers/pool/handoff_pipeline.py)
                                    slots freed (they stay pinned while a put still runs)

Runs in a thread (the copies and the pool calls block); the caller keeps the engine's blocks
until it returns, and it returns only once every copy it started has completed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.server.pd_worker import PDContext

log = logging.getLogger(__name__)


def write_blocks(
    ctx: PDContext,
    keys: list[str],
    block_ids: list[int],
    timings: dict[str, float],
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
