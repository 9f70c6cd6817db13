"""The pool as a shared prefix cache: a prompt's blocks that another request computed, on any
worker, read into this request's blocks instead of computed again.

    device match      await engine.acquire_prefix(tokens, 0): the device-cached run, with references
    lookup            one exists() batch on the full-block keys after it; the hit is the run
                      of present keys from the first (a hole ends it); the pool counts a key
                      present when every shard of it is: the minimum over TP ranks
                      (workers/engine/tp/sharded_pool.py)
    guards            hit < min_tokens -> not loaded (threshold); no free blocks -> not loaded
    lease             await engine.acquire_prefix(tokens, hit): device hits + fresh blocks to fill
    load              load_blocks (staging slots + swap_cache_layout host -> device), up to
                      the first key the pool cannot give complete (a put still in flight is
                      NOT_READY, a miss: never a torn block); bounded by load_timeout_s
    trim              blocks the pool did not fill go back; the rest are the request's KV

                  | device hits | pool hit (loaded)  | computed by the engine ... | last |
                  0          n_device           n_device + n_pool                  len-1

Only full blocks before the last prompt token can hit (its logits give the first token), the
same cap as the device cache. Every pool failure (an error, a timeout, blocks gone between
lookup and load) becomes a recompute of what is missing, counted; never a failed request.
A load that outlives its time bound still writes into the lease's blocks: the request goes
on without them (over fresh blocks) and the lease is given back when the copy has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.api import PrefixLease
from workers.handoff.priority_threads import handoff_threads
from workers.handoff.reader import ReadOutcome, load_blocks
from workers.handoff.slots import HandoffPool
from workers.pool.errors import PoolError
from workers.pool.keys import block_keys
from workers.server.cache_metrics import CacheMetrics

log = logging.getLogger(__name__)


class LeaseEngine(Protocol):
    """What the pool prefix read and the write-back call on the engine (AsyncEngine): every
    call that takes engine state is awaited or only posted, never run on the event loop."""

    @property
    def kv_caches(self) -> Sequence[object]: ...

    async def acquire_prefix(
        self, token_ids: Sequence[int], max_extra_blocks: int, cache_scope: str | None = None
    ) -> PrefixLease | None: ...

    async def trim_lease(self, lease: PrefixLease, num_filled_blocks: int) -> PrefixLease: ...

    def release_lease(self, lease: PrefixLease) -> None: ...


@dataclass(frozen=True)
class PrefixReadLimits:
    """The pool prefix read's bounds (from PDSettings)."""

    min_tokens: int  # a hit under it is not loaded
    load_timeout_s: float  # lookup + load; past it the request computes
    group_blocks: int  # blocks per copy and pool call
    wait_s: float  # bound on waiting for staging slots


@dataclass(frozen=True)
class PoolPrefix:
    """What a prefill request starts from: a lease to add it over (None: add it plain, the
    engine takes its own device hit) and the prompt tokens of that lease by source."""

    lease: PrefixLease | None = None
    num_device_tokens: int = 0
    num_pool_tokens: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0


def hit_run(present_by_rank: Sequence[Sequence[bool]]) -> int:
    """Blocks present from the first on, on every rank: the minimum of each rank's run."""
    runs = [
        next((i for i, p in enumerate(present) if not p), len(present))
        for present in present_by_rank
    ]
    return min(runs) if runs else 0


def lookup_keys(
    fingerprint: str, token_ids: Sequence[int], block_size: int, scope: str | None = None
) -> list[str]:
    """Keys of the full blocks a hit may cover: those within the first len - 1 tokens."""
    num_blocks = (len(token_ids) - 1) // block_size
    tokens = list(token_ids[: num_blocks * block_size])
    return block_keys(fingerprint, tokens, block_size, scope=scope)


@dataclass(frozen=True)
class PoolPrefixReader:
    """Reads a prompt's pool prefix into a lease (see the module doc); one per P worker.

    background holds a load abandoned past its bound until its copy ends (never collected
    mid-copy); the lease it writes into is released then."""

    engine: LeaseEngine
    pool: HandoffPool
    block_size: int
    limits: PrefixReadLimits
    metrics: CacheMetrics
    background: set[asyncio.Future[Any]]

    async def acquire(
        self,
        token_ids: Sequence[int],
        prompt_keys: Sequence[str],
        scope: str | None = None,
        priority: int = 0,
    ) -> PoolPrefix:
        """The device + pool prefix of token_ids as a lease. Never raises for a pool failure;
        the caller owns the lease (adds it with its request or releases it). prompt_keys:
        block_keys of token_ids under the cache scope (the lookup keys are their first
        blocks: the keys are chained, so the prompt is not hashed twice); the device match
        takes the same scope. The pool calls run on the handoff threads by priority (the
        request's: workers/handoff/priority_threads.py)."""
        if not self.pool.is_open:
            return PoolPrefix()
        keys = list(prompt_keys[: (len(token_ids) - 1) // self.block_size])
        if not keys:
            return PoolPrefix()
        device = await self.engine.acquire_prefix(token_ids, 0, scope)
        assert device is not None, "a lease without extra blocks always fits"
        try:
            return await self._extend_from_pool(token_ids, keys, device, scope, priority)
        finally:
            self.engine.release_lease(device)  # the pool lease took its own references

    async def _extend_from_pool(
        self,
        token_ids: Sequence[int],
        keys: list[str],
        device: PrefixLease,
        scope: str | None,
        priority: int,
    ) -> PoolPrefix:
        metrics, bs = self.metrics, self.block_size
        num_device = device.num_cached_blocks
        if num_device >= len(keys):
            return PoolPrefix()  # all in the device cache: the engine takes it itself
        t0 = time.monotonic()
        present = await self._lookup(keys[num_device:], priority)
        lookup_s = time.monotonic() - t0
        if present is None:
            return PoolPrefix(lookup_s=lookup_s)
        run = hit_run([present])
        metrics.hit_tokens.inc(run * bs)
        if run == 0:
            return PoolPrefix(lookup_s=lookup_s)
        if run * bs < self.limits.min_tokens:
            metrics.loads_skipped.labels(reason="threshold").inc()
            return PoolPrefix(lookup_s=lookup_s)
        lease = await self.engine.acquire_prefix(token_ids, run, scope)
        if lease is None:
            metrics.loads_skipped.labels(reason="no_blocks").inc()
            return PoolPrefix(lookup_s=lookup_s)
        # The device run can only have grown since (the first lease held its blocks).
        num_hits = lease.num_cached_blocks
        num_load = max(0, min(len(lease.extra_block_ids), num_device + run - num_hits))
        filled, load_s = await self._load_bounded(
            lease,
            keys[num_hits : num_hits + num_load],
            list(lease.extra_block_ids[:num_load]),
            t0 + self.limits.load_timeout_s,
            priority,
        )
        if filled is None:  # past the time bound: the lease goes back when the copy ends
            return PoolPrefix(lookup_s=lookup_s, load_s=load_s)
        lease = await self.engine.trim_lease(lease, filled)
        if filled == 0:
            self.engine.release_lease(lease)
            return PoolPrefix(lookup_s=lookup_s, load_s=load_s)
        return PoolPrefix(lease, num_hits * bs, filled * bs, lookup_s, load_s)

    async def _lookup(self, keys: list[str], priority: int) -> list[bool] | None:
        """Which keys the pool holds, or None (counted) on an error or past the bound."""
        self.metrics.lookups.inc()
        # The lookup and the load share one time bound: a master that stopped answering
        # (~4 s a call) must not hold the request either. The exists() thread touches no block.
        lookup = asyncio.ensure_future(handoff_threads().run(priority, self.pool.exists, keys))
        done, _ = await asyncio.wait({lookup}, timeout=self.limits.load_timeout_s)
        if lookup not in done:
            lookup.cancel()  # still queued: never run (it touches no block either way)
            self.metrics.loads_skipped.labels(reason="timeout").inc()
            log.warning(
                "pool prefix lookup past %.2fs: computing the prompt", self.limits.load_timeout_s
            )
            return None
        try:
            return lookup.result()
        except PoolError as exc:
            self.metrics.errors.inc()
            log.warning("pool prefix lookup failed (%s): computing the prompt", exc)
            return None

    async def _load_bounded(
        self,
        lease: PrefixLease,
        keys: list[str],
        block_ids: list[int],
        deadline_s: float,
        priority: int,
    ) -> tuple[int | None, float]:
        """(blocks filled, seconds), or (None, seconds) when the load ran past its bound; then
        the lease is released once the copy thread ends, never before (it writes its blocks)."""
        metrics = self.metrics
        t0 = time.monotonic()
        load = handoff_threads().submit(
            priority,
            load_blocks,
            self.pool,
            self.engine.kv_caches,
            keys,
            block_ids,
            group_blocks=self.limits.group_blocks,
            wait_s=self.limits.wait_s,
            deadline_s=deadline_s,
        )
        # Never cancelled: once started, the thread writes the lease's blocks to its end.
        task = asyncio.ensure_future(asyncio.wrap_future(load))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline_s - t0))
        except asyncio.CancelledError:
            self._release_after(task, lease)
            raise
        load_s = time.monotonic() - t0
        if task not in done:
            metrics.loads_skipped.labels(reason="timeout").inc()
            log.warning("pool prefix load of %d blocks past its bound: recomputing", len(keys))
            self._release_after(task, lease)
            return None, load_s
        try:
            outcome: ReadOutcome = task.result()
        except Exception as exc:  # a pool or staging failure: recompute, never fail the request
            metrics.errors.inc()
            log.warning("pool prefix load failed (%r): recomputing", exc)
            return 0, load_s
        if outcome.missing_keys:
            metrics.errors.inc()  # gone between lookup and load (evicted, owner lost, not ready)
        metrics.load_bytes.inc(outcome.num_bytes)
        metrics.load_s.observe(load_s)
        return outcome.num_loaded, load_s

    def _release_after(self, task: asyncio.Future[Any], lease: PrefixLease) -> None:
        """Give the lease back once task (a copy into its blocks) has ended."""
        engine = self.engine

        async def release() -> None:
            await asyncio.gather(task, return_exceptions=True)
            engine.release_lease(lease)

        waiter = asyncio.ensure_future(release())
        self.background.add(waiter)
        waiter.add_done_callback(self.background.discard)
