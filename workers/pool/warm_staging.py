"""Warming the pool owner's view of a shared-memory client's staging, once at connect.

Over shared memory the owner copies straight into and out of a client's staging through its
own mapping of it, which it fills in page by page on first use: the first gets into a fresh
worker's staging ran at 1.5-3.5 GB/s against 5-6 warm on an H100 host, 2.5-3.1 against
10-16 GB/s on the 2-core VM (docs/benchmarks/handoff.md). Touching the staging from the
worker's side does not help (it is the owner's page tables); putting every slot once does (the
owner reads each page): afterwards the first get ran at 10.3 GB/s on the VM. Those objects
are removed at once (a put takes no read lease), a batch at a time, so the pool holds at most
one batch of them. A warm-up that fails (a full pool, say) is logged and skipped: the client
works, only its first handoffs are slower.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

from workers.pool.errors import BatchResult, PoolError
from workers.pool.staging import SlotAllocator

log = logging.getLogger(__name__)
WARM_KEY_PREFIX = "pdwarm/"


class StagingClient(Protocol):
    """What the warm-up uses of KVPoolClient (which calls it from connect())."""

    slots: SlotAllocator

    def put_from(self, keys: Sequence[str], slots: Sequence[int]) -> BatchResult: ...

    def remove(self, keys: Sequence[str]) -> BatchResult: ...


def warm_staging(client: StagingClient, batch_slots: int = 16) -> bool:
    """Put every staging slot once under a throwaway key and remove it; True if all went."""
    t0 = time.monotonic()
    tag = uuid.uuid4().hex
    every = client.slots.allocate(client.slots.num_slots)
    if every is None:  # someone else uses the staging already: it warms by use
        return False
    try:
        for start in range(0, len(every), batch_slots):
            slots = every[start : start + batch_slots]
            keys = [f"{WARM_KEY_PREFIX}{tag}/{s}" for s in slots]
            try:
                put = client.put_from(keys, slots)
                removed = client.remove(put.ok_keys)
            except PoolError as exc:
                log.warning("staging warm-up skipped: %s", exc)
                return False
            if not put.ok or not removed.ok:
                log.warning(
                    "staging warm-up stopped: put %s, remove %s", put.error(), removed.error()
                )
                return False
    finally:
        client.slots.free(every)
    log.info("pool staging warmed: %d slots in %.0f ms", len(every), (time.monotonic() - t0) * 1000)
    return True
