"""Decode writes the answer back: when a request ends on D, the full blocks of its prompt and
output that the pool lacks are put, so the next turn of a chat hits them on any P.

    request ends (its blocks stay in D's device prefix cache, evictable)
    WriteBack.submit(tokens)          returns at once; the stream's end never waits for it
      slot free?  no -> skipped (busy), counted: bounded, best-effort
      engine.acquire_prefix(tokens, 0)    references on the cached blocks of tokens, so no
                                          allocation can evict or reuse them while they are
                                          copied out
      write_blocks(keys, block_ids)       exists() then swap device -> host + put_from of the
                                          keys the pool lacks (P's writer, in a thread)
      engine.release_lease(...)           only after the copy has ended

tokens is prompt + every output token; the last one never had its KV computed (no step ran
after it was sampled), and acquire_prefix's cap (full blocks within the first len - 1 tokens)
is exactly the blocks whose KV exists. A block evicted before the write-back took its
references is simply not written. Any failure is logged and counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from workers.pool.keys import block_keys

log = logging.getLogger(__name__)


class WriteBack:
    """Bounded, best-effort write-back of finished requests' blocks (one per decode worker)."""

    def __init__(self, ctx: Any, max_in_flight: int) -> None:
        self.ctx = ctx
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def submit(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Start writing back token_ids' full blocks in the background; False if skipped
        (too many in flight). Call from the event loop."""
        metrics = self.ctx.cache_metrics
        if self.in_flight >= self.max_in_flight:
            metrics.writeback_skipped.labels(reason="busy").inc()
            return False
        self.in_flight += 1
        task = asyncio.ensure_future(self._run(request_id, tuple(token_ids)))
        self.ctx.background.add(task)
        task.add_done_callback(self._done)
        return True

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        self.ctx.background.discard(task)

    async def _run(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        from workers.prefill.handoff_writer import write_blocks

        ctx = self.ctx
        metrics = ctx.cache_metrics
        try:
            engine = ctx.engine
            lease = engine.acquire_prefix(token_ids, 0)
        except Exception as exc:  # the engine died or is loading: nothing to write
            metrics.writeback_skipped.labels(reason="error").inc()
            log.warning("write-back of %s skipped: %r", request_id, exc)
            return
        try:
            num_blocks = lease.num_cached_blocks
            if not num_blocks:
                return
            bs = ctx.block_size
            keys = block_keys(ctx.fingerprint, list(token_ids[: num_blocks * bs]), bs)
            timings = {"d2h_s": 0.0, "put_s": 0.0}
            # tasks.finish_in_thread semantics: a cancelled write-back still waits for its copy.
            task = asyncio.ensure_future(
                asyncio.to_thread(write_blocks, ctx, keys, list(lease.block_ids), timings)
            )
            while not task.done():
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    continue
            written, skipped, num_bytes = task.result()
            metrics.writeback_blocks.inc(written)
            ctx.metrics.bytes_written.inc(num_bytes)
            log.info(
                "write-back %s: %d blocks written, %d already in the pool",
                request_id,
                written,
                skipped,
            )
        except Exception as exc:
            metrics.writeback_skipped.labels(reason="error").inc()
            log.warning("write-back of %s failed: %r", request_id, exc)
        finally:
            try:
                await asyncio.to_thread(engine.release_lease, lease)
            except Exception as exc:
                log.warning("write-back of %s: lease not released (%r)", request_id, exc)
