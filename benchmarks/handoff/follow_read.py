"""D reading behind P in the streamed bench: each key read as soon as the pool holds it.

    until every key is read (or stop is set, or the deadline passes):
        exists(next keys)           up to 4 groups past those read
        none there yet              sleep poll_s, ask again
        a run from the first        get_blocks over it (the workers' pipeline), in order

The decode worker's own reader for this (follow_blocks, in the handoff package) is being
written beside this bench and was not on the main branch when these tables were measured;
this loop has its shape and its guarantee (no block read before its put completed: a key
still being written is absent or answers not-ready, and get_blocks stops there), so the
coordinator can switch the bench to it. Runs in a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from workers.handoff.pipeline import get_blocks
from workers.handoff.slots import wait_for_slots

WINDOW_GROUPS = 4


def read_behind(
    pool: Any,
    kv_caches: Sequence[object],
    keys: Sequence[str],
    block_ids: Sequence[int],
    *,
    group_blocks: int,
    wait_s: float,
    poll_s: float,
    stop: threading.Event,
    deadline_s: float | None = None,
) -> int:
    """Blocks read into block_ids, in order, as their keys appear; returns how many."""
    loaded = 0
    while loaded < len(keys) and not stop.is_set():
        if deadline_s is not None and time.monotonic() >= deadline_s:
            break
        ahead = list(keys[loaded : loaded + group_blocks * WINDOW_GROUPS])
        present = pool.exists(ahead)
        ready = next((i for i, here in enumerate(present) if not here), len(ahead))
        if ready == 0:
            stop.wait(poll_s)
            continue
        by_s = time.monotonic() + wait_s
        outcome = get_blocks(
            pool,
            kv_caches,
            list(block_ids[loaded : loaded + ready]),
            list(keys[loaded : loaded + ready]),
            group_blocks,
            lambda n, by_s=by_s: wait_for_slots(pool, n, by_s),
        )
        loaded += outcome.num_loaded
        if outcome.num_loaded < ready:
            stop.wait(poll_s)
    return loaded
