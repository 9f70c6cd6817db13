"""The decode side of the handoff: a request's KV blocks out of the pool into the engine.

    group by group:           get_into(keys, slots)
                              swap_cache_layout host -> device for the blocks read, in order,
                              up to the first one the pool lacked; the get of group i+1 runs
                              while group i is copied in (workers/pool/handoff_pipeline.py)
    stop at the first miss:   the engine recomputes from there (policy `recompute`), or the
                              request fails naming the keys (policy `fail`)

Runs in a thread; the blocks it fills belong to the request, which is not added to the engine
before this returns, and it returns only once every copy it started has completed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.server.pd_worker import PDContext

log = logging.getLogger(__name__)


def load_blocks(
    ctx: PDContext,
    keys: list[str],
    block_ids: list[int],
    timings: dict[str, float],
    *,
    deadline_s: float | None = None,
    pipelined: bool = True,
) -> tuple[int, list[str], int]:
    """Read keys into block_ids up to the first miss: (blocks loaded, missing keys, bytes).

    missing keys are those of the group where reading stopped that the pool did not return.
    With deadline_s (monotonic), no group starts after it: the keys left count as missing.
    timings gets get_s and h2d_s added (with pipelined, the time spent waiting on each stage);
    pipelined=False moves one group at a time. Runs in a thread.
    """
    from workers.pool.handoff_pipeline import get_blocks

    pool = ctx.require_pool()
    slots_by_s = time.monotonic() + ctx.settings.wait_s
    if deadline_s is not None:
        slots_by_s = min(slots_by_s, deadline_s)
    stages: dict[str, float] = {}
    outcome = get_blocks(
        pool,
        ctx.engine.kv_caches,
        block_ids[: len(keys)],
        keys,
        ctx.settings.transfer_batch_blocks,
        lambda n: ctx.wait_for_slots(n, slots_by_s),
        stages,
        overlap=pipelined,
        stop_at_s=deadline_s,
    )
    timings["get_s"] += stages.get("pool_s", 0.0)
    timings["h2d_s"] += stages.get("copy_s", 0.0)
    if outcome.missing_keys:
        log.info("pool lacked %d of %d keys", len(outcome.missing_keys), len(keys))
    loaded = outcome.num_loaded
    return loaded, list(outcome.missing_keys), loaded * pool.config.slot_bytes
