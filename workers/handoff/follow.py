"""D reading behind P's writes: a request's keys read as each becomes readable in the pool.

    until every key is read, stop is set, or the deadline passes:
      exists(the next window of keys)       window = up to 4 groups after the keys read
      the run of present keys from the first (a hole ends it)
        none present -> wait poll_s (or until stop), ask again
        some         -> get_blocks over that run (workers/handoff/pipeline.py); it stops at
                        the first key the pool will not give complete, and the next round
                        asks from there

P writes a chunked prompt's blocks while its next chunk computes
(workers/handoff/writer.py ChunkedWrite), so by the time P answers D has already copied all
but the last chunk; the decode that adopts the reservation reads only what is left.

Never a torn block: a key whose put is still in flight is either absent from exists() or
answered -703 (not ready) by get_into, which the client retries within its budget and then
reports as not OK; get_blocks copies nothing past such a key, and this loop asks for it again
later. Runs in a thread; it returns only once every copy it started has completed, so the
caller may free the blocks as soon as it returns.

Polling, not Mooncake's event publisher: the master of the CPU wheel this project installs
(mooncake-transfer-engine-non-cuda 0.3.13.post1) accepts `--enable_kv_events` and
`--kv_events_bind_endpoint`, but its `/kv_events/status` answers `"enabled": false` and nothing
binds the endpoint (no ZMQ is linked in), so no event ever comes; where it works it needs a ZMQ
subscriber in every D (a new dependency) and a publisher socket no key protects. Measured here
(2-core VM, shared memory, groups of 8 keys put 20 ms apart): exists() sees a key 0.1-0.2 ms
(p50) after its put returned polling every 1 ms, 0.7 ms polling every 5 ms; one exists() of up
to 32 keys costs 0.3-0.5 ms (p50). 16 of 96 keys answered exists() before their put had
returned, which is why the get, not exists(), is what guards against a block still being
written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from workers.handoff.pipeline import GetOutcome, get_blocks
from workers.handoff.reader import ReadOutcome
from workers.handoff.slots import HandoffPool
from workers.handoff.timings import ReadTimings
from workers.pool.errors import PoolError

log = logging.getLogger(__name__)
WINDOW_GROUPS = 4  # groups asked about per exists(): one round trip covers a chunk's writes


def present_run(pool: HandoffPool, keys: Sequence[str]) -> int:
    """How many of keys, from the first, the pool holds (0 when it cannot say)."""
    try:
        present = pool.exists(keys)
    except PoolError as exc:  # a sick pool: ask again later; the adopting decode reads the rest
        log.debug("exists failed while following: %s", exc)
        return 0
    return next((i for i, here in enumerate(present) if not here), len(keys))


def read_run(
    pool: HandoffPool,
    kv_caches: Sequence[object],
    keys: Sequence[str],
    block_ids: Sequence[int],
    part: range,
    group_blocks: int,
    wait_s: float,
    deadline_s: float | None,
) -> GetOutcome:
    """keys[part] read into block_ids[part] through the group pipeline, up to the first key
    the pool will not give complete; slots waited for up to wait_s."""
    slots_by_s = time.monotonic() + wait_s
    return get_blocks(
        pool,
        kv_caches,
        [block_ids[j] for j in part],
        [keys[j] for j in part],
        group_blocks,
        slots_by_s,
        stop_at_s=deadline_s,
    )


def follow_blocks(
    pool: HandoffPool,
    kv_caches: Sequence[object],
    keys: Sequence[str],
    block_ids: Sequence[int],
    *,
    group_blocks: int,
    wait_s: float,
    poll_s: float,
    stop: threading.Event,
    deadline_s: float | None = None,
) -> ReadOutcome:
    """Read keys[i] into block_ids[i] in order as the pool comes to hold them. Runs in a thread.

    Returns when every key is read, `stop` is set, or deadline_s (time.monotonic) passes;
    missing_keys are the keys not read. Staging slots are waited for up to wait_s per read
    (then 503 staging_full is raised, after every copy started has completed).
    """
    if len(block_ids) < len(keys):
        raise ValueError(f"{len(block_ids)} block ids for {len(keys)} keys")
    if poll_s <= 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s}")
    loaded = 0
    timings = ReadTimings()
    window = max(1, group_blocks) * WINDOW_GROUPS
    while loaded < len(keys) and not stop.is_set():
        if deadline_s is not None and time.monotonic() >= deadline_s:
            break
        ready = present_run(pool, keys[loaded : loaded + window])
        if ready == 0:
            stop.wait(poll_s)
            continue
        part = range(loaded, loaded + ready)
        outcome = read_run(pool, kv_caches, keys, block_ids, part, group_blocks, wait_s, deadline_s)
        loaded += outcome.num_loaded
        timings += outcome.timings
        if outcome.num_loaded < ready:  # not ready after all (or evicted): ask again later
            stop.wait(poll_s)
    num_bytes = loaded * pool.config.slot_bytes
    return ReadOutcome(loaded, tuple(keys[loaded:]), num_bytes, timings)
