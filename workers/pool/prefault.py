"""Pre-faulting the pool owner's memory at start, so that the first puts run at full speed.

    pdworker pool start ─► mooncake_client mounts --size bytes (untouched: no page behind it)
                       ─► prefault(): put zero objects over 85% of it, then remove them
                       ─► /health 200: every put from now on writes memory that exists

The owner's segment is plain anonymous memory that the kernel hands out page by page on
first touch, and one owner thread does all the copying: measured, the first put into a fresh
pool ran at 0.3-1.9 GB/s with one minor fault per 4 KiB page, a put into touched memory at
6.6-9.7 GB/s (docs/benchmarks/handoff_probes.md, "fill + remove at start"). On the GPU hosts
the host's memory itself is also handed out lazily (about 3 s per 8 GiB), which is paid here,
once, at start, instead of on a request's time-to-first-token.

The fill goes through a TCP pool client in this process (a shared-memory client would leave
its shm segment behind: Mooncake does not release it on close). Failure is not fatal: the
pool still works, only its first writes are slow, so it is logged and the owner serves.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("pdworker.pool")

FILL_FRACTION = 0.85  # below the eviction watermark (MasterConfig: 0.9)
VALUE_BYTES = 4 << 20  # large values: a few thousand keys for a big pool
BATCH_KEYS = 16


@dataclass(frozen=True)
class PrefaultResult:
    """What the fill touched and how long it took (all of it counted in the owner's start)."""

    bytes_written: int
    seconds: float
    error: str | None = None


def prefault_keys(count: int) -> list[str]:
    """The fill's keys: a prefix no KV key has (keys.py keys start with a namespace/)."""
    return [f"__pdworker_prefault__/{os.getpid()}/{i}" for i in range(count)]


def prefault(
    master_addr: str, metadata_url: str, size_bytes: int, fraction: float = FILL_FRACTION
) -> PrefaultResult:
    """Write zeros over `fraction` of the pool and remove them again; never raises."""
    from workers.pool.client import KVPoolClient, PoolClientConfig
    from workers.pool.errors import PoolError

    start = time.monotonic()
    value_bytes = min(VALUE_BYTES, size_bytes)
    keys = prefault_keys(int(size_bytes * fraction) // value_bytes)
    config = PoolClientConfig(
        master_addr=master_addr,
        metadata_url=metadata_url,
        num_slots=BATCH_KEYS,
        slot_bytes=value_bytes,
        call_timeout_s=60.0,
    )
    written: list[str] = []
    error = None
    try:
        with KVPoolClient(config) as client:
            slots = client.slots.allocate(BATCH_KEYS)
            assert slots is not None, "a fresh client has every slot free"
            try:
                for first in range(0, len(keys), BATCH_KEYS):
                    batch = keys[first : first + BATCH_KEYS]
                    result = client.put_from(batch, slots[: len(batch)])
                    written.extend(result.ok_keys)
                    if not result.ok:
                        error = f"put stopped: {result.error()}"
                        break
            finally:
                client.slots.free(slots)
            for first in range(0, len(written), 256):
                removed = client.remove(written[first : first + 256])
                if not removed.ok:
                    error = error or f"remove failed: {removed.error()}"
    except PoolError as exc:
        error = str(exc)
    return PrefaultResult(len(written) * value_bytes, time.monotonic() - start, error)
