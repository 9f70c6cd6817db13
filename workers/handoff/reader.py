"""The decode side of the handoff: a request's KV blocks out of the pool into the engine.

    group by group:           get_into(keys, slots)
                              swap_cache_layout host -> device for the blocks read, in order,
                              up to the first one the pool lacked; the get of group i+1 runs
                              while group i is copied in (workers/handoff/pipeline.py)
    stop at the first miss:   the engine recomputes from there (policy `recompute`), or the
                              request fails naming the keys (policy `fail`)

Runs in a thread; the blocks it fills belong to the request, which is not added to the engine
before this returns, and it returns only once every copy it started has completed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.handoff.pipeline import get_blocks
from workers.handoff.slots import HandoffPool
from workers.handoff.timings import ReadTimings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadOutcome:
    """Blocks loaded in order up to the first miss, the keys missing in the group where
    reading stopped, bytes read, and what the read waited on."""

    num_loaded: int = 0
    missing_keys: tuple[str, ...] = ()
    num_bytes: int = 0
    timings: ReadTimings = field(default_factory=ReadTimings)


def load_blocks(
    pool: HandoffPool,
    kv_caches: Sequence[object],
    keys: Sequence[str],
    block_ids: Sequence[int],
    *,
    group_blocks: int,
    wait_s: float,
    deadline_s: float | None = None,
    pipelined: bool = True,
) -> ReadOutcome:
    """Read keys[i] into block_ids[i] up to the first miss. Runs in a thread.

    Staging slots are waited for up to wait_s (then 503 staging_full). With deadline_s
    (time.monotonic), no group starts after it: the keys left count as missing.
    pipelined=False moves one group at a time (the serialized baseline).
    """
    slots_by_s = time.monotonic() + wait_s
    if deadline_s is not None:
        slots_by_s = min(slots_by_s, deadline_s)
    outcome = get_blocks(
        pool,
        kv_caches,
        list(block_ids[: len(keys)]),
        list(keys),
        group_blocks,
        slots_by_s,
        overlap=pipelined,
        stop_at_s=deadline_s,
    )
    if outcome.missing_keys:
        log.info("pool lacked %d of %d keys", len(outcome.missing_keys), len(keys))
    loaded = outcome.num_loaded
    return ReadOutcome(
        loaded, outcome.missing_keys, loaded * pool.config.slot_bytes, outcome.timings
    )
