"""PrefixCache: the device prefix cache, the scheduler's view of which blocks hold known KV.

Plain ints and strings, no Paddle. A full block is named by the chained hash of its tokens and
every token before them (workers.pool.keys.next_block_hash with the engine's model fingerprint:
the pool keys' hash, so a device hit and a pool hit never disagree) and by the request's cache
scope, which enters the chain's root: blocks of two scopes never match each other. BlockPool
keeps the hash map and the eviction order; this module decides when a sequence's blocks enter
and leave it:

    register   a full block gets its hash once its KV is written: in update(), as
               num_computed_tokens passes its end (prompt and output blocks alike); a block
               handed in preallocated (D's load of P's handoff, a lease's blocks filled from
               the pool) when its request is added
    match      a request without blocks (new, or resumed after a preemption) takes, when it is
               admitted, the longest run of cached blocks from its start, with references.
               The run is capped at the full blocks within its first num_tokens - 1 tokens:

                   tokens   | b0 | b1 | b2 |x|       9 tokens, block_size 4: b0, b1 may hit;
                   tokens   | b0 | b1 | b2 |         8 tokens: only b0 and b1 may hit, b2 is
                                                     computed (it holds the last token)

               so the last known token is always computed (its logits give the next one) and a
               shared block is never written
    release    finish, preemption, abort and release drop references, tail first, so a
               sequence's prefix stays cached longest; blocks stay cached (evictable) until an
               allocation evicts them, least recently released first

With a host tier (workers/engine/host_tier.py), the match goes on past the device run: the
host entries that continue it are swapped in (fresh blocks, one H2D copy, registered as
device blocks once it landed: start_swap_in / finish_swap_in for the scheduler, which runs
other steps meanwhile (workers/engine/swap_ins.py); within acquire() for a lease), so the hit
is the longest run across both tiers, and counts as a host hit for the request it was for.
The tier hears of every registration, device hit and device eviction (its write policy
decides which of them copy a block to host memory).

Two requests computing the same new prefix at once both compute it (correct, just not
shared): the first to register wins, the other's block stays uncached and is freed normally.
With caching off nothing here hashes, matches or registers: the pool is today's FIFO.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from workers.engine.api import PrefixLease
from workers.engine.block_pool import BlockPool
from workers.engine.host_tier import BlockRef, HostTier, PendingRead
from workers.engine.request_state import RequestState
from workers.pool.keys import next_block_hash

log = logging.getLogger(__name__)
TokenSlice = Callable[[int, int], Sequence[int]]  # (start, end) -> tokens at [start, end)


@dataclass
class PromptTokenSources:
    """Prompt tokens by where their KV came from (see EngineStats)."""

    device_hit: int = 0
    host_hit: int = 0
    given_cached: int = 0
    loaded: int = 0
    computed: int = 0

    def count(
        self,
        state: RequestState,
        num_device_hit_tokens: int,
        num_given_cached_tokens: int,
        num_host_hit_tokens: int = 0,
    ) -> None:
        """Count state's prompt tokens, once: [0, num_computed_tokens) came from the device
        cache, the host tier or the caller, the rest is computed here."""
        num_prompt = state.num_prompt_tokens
        num_given = min(state.num_computed_tokens, num_prompt)
        device = min(num_device_hit_tokens, num_given)
        host = min(num_host_hit_tokens, num_given - device)
        cached = min(max(num_given_cached_tokens - device - host, 0), num_given - device - host)
        self.device_hit += device
        self.host_hit += host
        self.given_cached += cached
        self.loaded += num_given - device - host - cached
        self.computed += num_prompt - num_given


class PrefixCache:
    """Hashes, matches and registers sequences' full blocks in a BlockPool."""

    def __init__(
        self, pool: BlockPool, block_size: int, fingerprint: str, host: HostTier | None = None
    ) -> None:
        if pool.enable_caching and not fingerprint:
            raise ValueError("a prefix-caching BlockPool needs the model fingerprint")
        if host is not None and not pool.enable_caching:
            raise ValueError("a host tier needs the device prefix cache on")
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enabled = pool.enable_caching
        self.host = host
        self._swapped_in: set[int] = set()  # swapped-in blocks no request has taken yet
        if host is not None:
            pool.on_evict = self._on_device_evict

    # ---- requests in the scheduler --------------------------------------------------------

    def match(self, state: RequestState) -> list[int]:
        """The cached blocks for the start of state's sequence (no references taken)."""
        max_blocks = (state.num_tokens - 1) // self.block_size
        return self._match(state.block_hashes, max_blocks, state.token_ids, state.cache_scope)

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of block_ids a touch would take off the free lists."""
        return sum(1 for b in block_ids if self.pool.ref_count(b) == 0)

    def match_host(self, state: RequestState, num_device_blocks: int) -> int:
        """How many host-tier blocks continue state's device run (within the match's cap)."""
        if self.host is None:
            return 0
        max_blocks = (state.num_tokens - 1) // self.block_size
        return self._host_run(
            state.block_hashes, num_device_blocks, max_blocks, state.token_ids, state.cache_scope
        )

    def take(self, state: RequestState, hit_ids: Sequence[int]) -> int:
        """Give a request without blocks the hit blocks (references, computed, registered).
        Returns how many of them a lease swapped in from the host tier (host hits)."""
        assert not state.block_ids, f"{state.request_id} already holds blocks"
        self.pool.touch(hit_ids)
        state.block_ids = list(hit_ids)
        state.num_computed_tokens = len(hit_ids) * self.block_size
        state.num_registered_blocks = len(hit_ids)
        return self._count_hits(hit_ids, state.block_hashes)

    def start_swap_in(self, state: RequestState, num_host_blocks: int) -> PendingRead | None:
        """Fresh blocks after state's (computed, registered) blocks, appended to its table,
        and the copy of the next num_host_blocks host entries into them started; None
        (nothing taken) when there is no room or the copy could not start. Until
        finish_swap_in the blocks are neither computed nor cached: nobody reads them."""
        assert self.host is not None and state.num_registered_blocks == len(state.block_ids)
        start = len(state.block_ids)
        hashes = state.block_hashes[start : start + num_host_blocks]
        self.host.pin(hashes)  # the allocation's write-backs must not evict them
        try:
            block_ids = self.pool.allocate(len(hashes))
            if block_ids is None:
                return None
            try:
                pending = self.host.start_read(hashes, block_ids)
            except Exception as exc:  # the request computes those blocks instead
                log.warning("host tier swap-in of %d blocks failed: %r", len(hashes), exc)
                self.pool.free(block_ids)
                return None
        finally:
            self.host.unpin(hashes)
        state.block_ids.extend(block_ids)
        return pending

    def finish_swap_in(self, state: RequestState, pending: PendingRead) -> int:
        """Wait for a started swap-in; its blocks become computed and cached (state's host
        hit), or, if the copy failed, go back (the request computes them). Returns the
        blocks swapped in."""
        assert self.host is not None
        n = len(pending.block_ids)
        assert tuple(state.block_ids[-n:]) == pending.block_ids, state.request_id
        try:
            self.host.finish_read(pending)
        except Exception as exc:
            log.warning("host tier swap-in of %d blocks failed: %r", n, exc)
            del state.block_ids[-n:]
            self.pool.free(pending.block_ids)
            return 0
        for block_id, block_hash in zip(pending.block_ids, pending.hashes, strict=True):
            self.pool.cache_block(block_id, block_hash)
        state.num_computed_tokens += n * self.block_size
        state.num_registered_blocks += n
        return n

    def register_computed(self, state: RequestState) -> None:
        """Register the full blocks whose KV is now written (first registration wins)."""
        num_full = state.num_computed_tokens // self.block_size
        if not self.enabled or num_full <= state.num_registered_blocks:
            return
        self._extend_hashes(state.block_hashes, num_full, state.token_ids, state.cache_scope)
        registered: list[BlockRef] = []
        for i in range(state.num_registered_blocks, num_full):
            ref = (state.block_ids[i], state.block_hashes[i])
            if self.pool.cache_block(*ref):
                registered.append(ref)
        state.num_registered_blocks = num_full
        if self.host is not None:
            self.host.on_registered(registered)

    def check_preallocated(self, state: RequestState, table_refs: Mapping[int, int]) -> None:
        """Raise ValueError unless the caller holds a reference of its own on each
        preallocated block and each block is either private and uncached, or a device hit
        (cached under this sequence's hash for its index, in the computed full blocks)."""
        rid = state.request_id
        for block_id in state.block_ids:
            if self.pool.ref_count(block_id) == 0:
                raise ValueError(
                    f"request {rid!r}: preallocated block {block_id} is free; "
                    "get blocks from allocate_blocks() first"
                )
        hits = {i for i, b in enumerate(state.block_ids) if self._is_hit(state, i, b)}
        shared = [
            b
            for i, b in enumerate(state.block_ids)
            if table_refs.get(b, 0) and (i not in hits or self.pool.ref_count(b) <= table_refs[b])
        ]
        if shared:
            raise ValueError(
                f"request {rid!r}: preallocated blocks {shared} belong to live requests"
            )
        foreign = [
            b
            for i, b in enumerate(state.block_ids)
            if i not in hits and self.pool.block_hash(b) is not None
        ]
        if foreign:
            raise ValueError(
                f"request {rid!r}: preallocated blocks {foreign} are cached with other "
                "tokens' KV (only a lease's device hits may be passed cached)"
            )

    def adopt(self, state: RequestState) -> tuple[int, int]:
        """Register a checked request's preallocated full computed blocks; how many of them
        were cached already: (device hits, of them swapped in from the host tier)."""
        num_full = state.num_computed_tokens // self.block_size
        if not self.enabled:
            return 0, 0
        self._extend_hashes(state.block_hashes, num_full, state.token_ids, state.cache_scope)
        hits: list[BlockRef] = []
        registered: list[BlockRef] = []
        for i in range(num_full):
            ref = (state.block_ids[i], state.block_hashes[i])
            if self.pool.block_hash(ref[0]) == ref[1]:
                hits.append(ref)
            elif self.pool.cache_block(*ref):
                registered.append(ref)
        state.num_registered_blocks = num_full
        if self.host is not None:
            self.host.on_registered(registered)
        return len(hits), self._count_hits([b for b, _ in hits], [h for _, h in hits])

    def flush_host(self) -> None:
        """Make the host tier's pending copies (end of a step)."""
        if self.host is not None:
            self.host.flush()

    def free_sequence(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each of a sequence's blocks; with caching on, tail first, so
        that its later blocks are evicted before its prefix."""
        self.pool.free(reversed(block_ids) if self.enabled else block_ids)

    # ---- leases (before a request is added) -----------------------------------------------

    def acquire(
        self, token_ids: Sequence[int], max_extra_blocks: int, scope: str | None = None
    ) -> PrefixLease | None:
        """Device hits for token_ids (under the cache scope) plus up to max_extra_blocks fresh
        blocks after them, all within positions [0, len(token_ids) - 1); None (nothing taken)
        when the extra blocks do not fit. With max_extra_blocks == 0 it never returns None."""
        if not token_ids:
            raise ValueError("acquire_prefix() needs at least one token")
        if max_extra_blocks < 0:
            raise ValueError(
                f"acquire_prefix() needs max_extra_blocks >= 0, got {max_extra_blocks}"
            )
        tokens = tuple(token_ids)
        bs, hashes = self.block_size, []
        max_blocks = (len(tokens) - 1) // bs
        token_slice: TokenSlice = lambda a, b: tokens[a:b]  # noqa: E731
        hit_ids = self._match(hashes, max_blocks, token_slice, scope)
        num_host = self._host_run(hashes, len(hit_ids), max_blocks, token_slice, scope)
        num_extra = min(max_extra_blocks, -(-(len(tokens) - 1) // bs) - len(hit_ids) - num_host)
        num_room = self.pool.num_free - self.num_evictable(hit_ids) - num_extra
        if num_extra and num_room < 0:
            return None
        self.pool.touch(hit_ids)  # before allocating, which could evict them
        start = len(hit_ids)
        hit_ids += self._swap_in(hashes[start : start + max(0, min(num_host, num_room))])
        extra_ids = self.pool.allocate(num_extra)
        assert extra_ids is not None
        return PrefixLease(tuple(hit_ids + extra_ids), len(hit_ids), bs, len(tokens))

    def trim(self, lease: PrefixLease, num_filled_blocks: int) -> PrefixLease:
        """Give back the extra blocks after the first num_filled_blocks; the lease kept."""
        extra_ids = lease.extra_block_ids
        if not 0 <= num_filled_blocks <= len(extra_ids):
            raise ValueError(
                f"trim_lease() of {num_filled_blocks} filled blocks: the lease has "
                f"{len(extra_ids)} extra blocks"
            )
        self.free_sequence(extra_ids[num_filled_blocks:])
        kept = lease.block_ids[: lease.num_cached_blocks + num_filled_blocks]
        return PrefixLease(kept, lease.num_cached_blocks, lease.block_size, lease.num_tokens)

    # ---- helpers ----------------------------------------------------------------------------

    def _match(
        self, hashes: list[str], max_blocks: int, tokens: TokenSlice, scope: str | None
    ) -> list[int]:
        hit_ids: list[int] = []
        if not self.enabled:
            return hit_ids
        for i in range(max_blocks):  # hash lazily: a miss ends the run
            self._extend_hashes(hashes, i + 1, tokens, scope)
            block_id = self.pool.lookup(hashes[i])
            if block_id is None:
                break
            hit_ids.append(block_id)
        return hit_ids

    def _host_run(
        self, hashes: list[str], start: int, max_blocks: int, tokens: TokenSlice, scope: str | None
    ) -> int:
        if self.host is None:
            return 0
        n = 0
        for i in range(start, max_blocks):  # hash lazily: a miss ends the run
            self._extend_hashes(hashes, i + 1, tokens, scope)
            if hashes[i] not in self.host:
                break
            n += 1
        return n

    def _swap_in(self, hashes: Sequence[str]) -> list[int]:
        """Fresh blocks holding the host entries of hashes, referenced and registered; []
        when there is no room or the copy failed (the blocks went back)."""
        if not hashes or self.host is None:
            return []
        self.host.pin(hashes)  # the allocation's write-backs must not evict them
        try:
            block_ids = self.pool.allocate(len(hashes))
            if block_ids is None:
                return []
            try:
                self.host.read(hashes, block_ids)
            except Exception as exc:  # a lost swap-in is a recompute, never a failed step
                log.warning("host tier swap-in of %d blocks failed: %r", len(hashes), exc)
                self.pool.free(block_ids)
                return []
        finally:
            self.host.unpin(hashes)
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if self.pool.cache_block(block_id, block_hash):
                self._swapped_in.add(block_id)
        return block_ids

    def _count_hits(self, block_ids: Sequence[int], hashes: Sequence[str]) -> int:
        """Tell the host tier of the device hits among block_ids; how many were swapped in
        (those count as host hits, once)."""
        from_host = [b for b in block_ids if b in self._swapped_in]
        self._swapped_in.difference_update(from_host)
        if self.host is not None:
            refs = zip(block_ids, hashes, strict=False)
            self.host.on_device_hits((b, h) for b, h in refs if b not in from_host)
        return len(from_host)

    def _on_device_evict(self, refs: list[BlockRef]) -> None:
        self._swapped_in.difference_update(b for b, _ in refs)
        assert self.host is not None
        self.host.on_device_evict(refs)

    def _is_hit(self, state: RequestState, index: int, block_id: int) -> bool:
        """Is block_id cached under state's hash for block index, within its computed KV?"""
        cached = self.pool.block_hash(block_id)
        if cached is None or index >= state.num_computed_tokens // self.block_size:
            return False
        self._extend_hashes(state.block_hashes, index + 1, state.token_ids, state.cache_scope)
        return cached == state.block_hashes[index]

    def _extend_hashes(
        self, hashes: list[str], num_blocks: int, tokens: TokenSlice, scope: str | None
    ) -> None:
        bs, fingerprint = self.block_size, self.fingerprint
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            block = tokens(i * bs, (i + 1) * bs)
            hashes.append(next_block_hash(fingerprint, parent, block, scope))
