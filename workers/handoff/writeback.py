"""Decode writes the answer back: when a request ends on D, the full blocks of its prompt and
output that the pool lacks are put, so the next turn of a chat hits them on any P.

    request ends (its blocks stay in D's device prefix cache, evictable)
    WriteBack.submit(tokens)          returns at once; the stream's end never waits for it
      slot free?  no -> skipped (busy), counted: bounded, best-effort
      await engine.acquire_prefix(tokens, 0, scope)  references on the cached blocks of tokens
                                          (under the request's cache scope), so no
                                          allocation can evict or reuse them while they are
                                          copied out
      write_blocks(keys, block_ids)       exists() then swap device -> host + put_from of the
                                          keys the pool lacks (writer.py, in a thread)
      engine.release_lease(...)           only after the copy has ended

tokens is prompt + every output token; the last one never had its KV computed (no step ran
after it was sampled), and acquire_prefix's cap (full blocks within the first len - 1 tokens)
is exactly the blocks whose KV exists. The keys are under the request's cache scope (the one
P and D ran it under), so a tenant's answer is written back for that tenant only. A block
evicted before the write-back took its references is simply not written. Any failure is
logged and counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from workers.handoff.pool_prefix import LeaseEngine
from workers.handoff.slots import HandoffPool
from workers.handoff.tasks import finish_in_thread
from workers.handoff.writer import write_blocks
from workers.pool.keys import block_keys
from workers.server.cache_metrics import CacheMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteBackTarget:
    """Where write-back reads and writes: the engine, the pool, the key scheme, the bounds."""

    engine: LeaseEngine
    pool: HandoffPool
    fingerprint: str
    block_size: int
    group_blocks: int
    wait_s: float


class WriteBack:
    """Bounded, best-effort write-back of finished requests' blocks (one per decode worker).

    background holds each write-back until it ends (never collected mid-copy);
    bytes_written counts the bytes it put (the worker's pool byte counter)."""

    def __init__(
        self,
        max_in_flight: int,
        metrics: CacheMetrics,
        bytes_written: Counter,
        background: set[asyncio.Future[Any]],
    ) -> None:
        self.max_in_flight = max_in_flight
        self.metrics = metrics
        self.bytes_written = bytes_written
        self.background = background
        self.in_flight = 0

    def submit(
        self,
        target: WriteBackTarget,
        request_id: str,
        token_ids: Sequence[int],
        scope: str | None = None,
    ) -> bool:
        """Start writing back token_ids' full blocks (under the cache scope) in the
        background; False if skipped (too many in flight). Call from the event loop."""
        if self.in_flight >= self.max_in_flight:
            self.metrics.writeback_skipped.labels(reason="busy").inc()
            return False
        self.in_flight += 1
        task = asyncio.ensure_future(self._run(target, request_id, tuple(token_ids), scope))
        self.background.add(task)
        task.add_done_callback(self._done)
        return True

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        self.background.discard(task)

    async def _run(
        self,
        target: WriteBackTarget,
        request_id: str,
        token_ids: tuple[int, ...],
        scope: str | None,
    ) -> None:
        metrics = self.metrics
        try:
            lease = await target.engine.acquire_prefix(token_ids, 0, scope)
            assert lease is not None, "a lease without extra blocks always fits"
        except Exception as exc:  # the engine died: nothing to write
            metrics.writeback_skipped.labels(reason="error").inc()
            log.warning("write-back of %s skipped: %r", request_id, exc)
            return
        try:
            num_blocks = lease.num_cached_blocks
            if not num_blocks:
                return
            bs = target.block_size
            tokens = list(token_ids[: num_blocks * bs])
            keys = block_keys(target.fingerprint, tokens, bs, scope=scope)
            # A cancelled write-back still waits for its copy: the lease is released after.
            outcome = await finish_in_thread(
                write_blocks,
                target.pool,
                target.engine.kv_caches,
                keys,
                lease.block_ids,
                group_blocks=target.group_blocks,
                wait_s=target.wait_s,
            )
            metrics.writeback_blocks.inc(outcome.num_written)
            self.bytes_written.inc(outcome.num_bytes)
            log.info(
                "write-back %s: %d blocks written, %d already in the pool",
                request_id,
                outcome.num_written,
                outcome.num_skipped,
            )
        except Exception as exc:
            metrics.writeback_skipped.labels(reason="error").inc()
            log.warning("write-back of %s failed: %r", request_id, exc)
        finally:
            try:
                target.engine.release_lease(lease)
            except Exception as exc:
                log.warning("write-back of %s: lease not released (%r)", request_id, exc)
