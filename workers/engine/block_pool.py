"""BlockPool: the KV cache's block allocator, with reference counts, a FIFO free list and, with
prefix caching on, an index of cached blocks by their chained block hash.

Plain ints and strings, no Paddle: the pool hands out block ids; the runner's KV tensors are
indexed by them. Each block is in exactly one state:

    referenced   ref count > 0: in a block table, held by a prefill_only request or by a
                 caller (allocate_blocks, a prefix lease); it may carry a hash
    free         ref count 0, no hash (never cached, or evicted): on the free list
    evictable    ref count 0 with a hash: its KV is still valid and a new request may take it
                 back (touch); on the evictable list, least recently released first

Allocation order is deterministic so that tests can assert exact block ids:

    free list (front -> back):    [3, 4, 5]
    evictable (LRU -> MRU):       [0, 2]            0 was released before 2
    allocate(4) -> [3, 4, 5, 0]   the free list first, then the least recently released cached
                                  block, whose hash is dropped (evicted)
    free([7, 1]) ->               a block whose count drops to 0 goes to the back of the free
                                  list, or of the evictable list if it carries a hash, in the
                                  order of the ids passed to free()

Freed uncached blocks are therefore the last uncached ones to be reused, which keeps their
stale KV around as long as possible (useful when reading logs and debugging a leak). With
caching off (the default) no block ever carries a hash: the evictable list stays empty and
the pool is a plain FIFO allocator.

A hash names a block's content: the KV of one full block of one token sequence (the chained
hashes of workers/pool/keys.py). A block carries at most one hash, a hash names at most one
block (the first registration wins: a second block computed with the same content stays
uncached), and a cached block is never written again until it is evicted.

on_evict, when set (the host tier's write policies), hears of every eviction: allocate()
calls it once with the (block id, hash) pairs it evicted, before it returns, while their KV
is still intact.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from workers.engine.block_events import BlockEventLog


class BlockPool:
    """Reference-counted allocator over block ids [0, num_blocks), optionally a prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[str, int] = {}
        self._block_to_hash: dict[int, str] = {}
        self.on_evict: Callable[[list[tuple[int, str]]], None] | None = None
        # What the device tier gains and loses, for routers (None with caching off).
        self.events = BlockEventLog() if enable_caching else None

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: free plus evictable."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Referenced blocks."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks carrying a hash, referenced or evictable."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_ids(self) -> list[int]:
        """Every block allocate() may hand out, in the order it would (free list, then
        evictable LRU first). For tests and debugging."""
        return [*self._free_ids, *self._evictable]

    def block_hash(self, block_id: int) -> str | None:
        """The hash a block is cached under, or None."""
        self._check_id(block_id)
        return self._block_to_hash.get(block_id)

    def lookup(self, block_hash: str) -> int | None:
        """The block cached under block_hash (referenced or evictable), or None."""
        return self._hash_to_block.get(block_hash)

    def cached_blocks(self) -> dict[str, int]:
        """A copy of the hash -> block map, in registration order. For tests and debugging."""
        return dict(self._hash_to_block)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks blocks, free list first, then evicting the least recently released
        cached blocks; each gets count 1 and no hash.

        Returns None (and takes nothing) when fewer than num_blocks are free or evictable.
        """
        if num_blocks < 0:
            raise ValueError(f"allocate() needs num_blocks >= 0, got {num_blocks}")
        if num_blocks > self.num_free:
            return None
        block_ids = []
        evicted: list[tuple[int, str]] = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._block_to_hash.pop(block_id)
                del self._hash_to_block[block_hash]
                evicted.append((block_id, block_hash))
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        if evicted and self.events is not None:
            self.events.removed("device", [block_hash for _, block_hash in evicted])
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (already referenced) block, e.g. a shared prefix block."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"incref() of block {block_id}, which is free")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each cached block (a prefix hit); an evictable one leaves the
        evictable list. Raises ValueError (and changes nothing) for a block without a hash."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if block_id not in self._block_to_hash:
                raise ValueError(f"touch() of block {block_id}, which is not cached")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: str) -> bool:
        """Register a referenced block, whose KV is now written, under its content's hash.

        True if the block is cached under block_hash afterwards; False if another block
        already is (first registration wins; this one stays uncached and is freed normally).
        Raises ValueError if caching is off, the block is free or carries another hash.
        """
        self._check_id(block_id)
        if not self.enable_caching:
            raise ValueError("cache_block() on a BlockPool with caching off")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cache_block() of block {block_id}, which is free")
        current = self._block_to_hash.get(block_id)
        if current is not None:
            if current != block_hash:
                raise ValueError(
                    f"cache_block() of block {block_id} under {block_hash[:12]}: it is cached "
                    f"under {current[:12]} (a cached block is never rewritten)"
                )
            return True
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        if self.events is not None:
            self.events.stored("device", (block_hash,))
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the back of the free
        list, or of the evictable list if it is cached.

        Raises ValueError (and changes nothing) if a block would drop below zero, which means
        a double free somewhere upstream.
        """
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, num_drops in drops.items():
            if num_drops > self._ref_counts[block_id]:
                raise ValueError(
                    f"free() of block {block_id}: {num_drops} release(s) but ref count is "
                    f"{self._ref_counts[block_id]} (double free)"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._block_to_hash:
                    self._evictable[block_id] = None
                else:
                    self._free_ids.append(block_id)

    def check_integrity(self) -> None:
        """Assert every block is referenced (count > 0, maybe cached) xor listed once as free
        (no hash) or evictable (a hash), and that the hash map is a bijection."""
        free_set = set(self._free_ids)
        assert len(free_set) == len(self._free_ids), (
            f"free list holds duplicates: {sorted(self._free_ids)}"
        )
        both = free_set & self._evictable.keys()
        assert not both, f"blocks {sorted(both)} are both free and evictable"
        assert len(self._hash_to_block) == len(self._block_to_hash), (
            f"{len(self._hash_to_block)} hashes map to blocks but "
            f"{len(self._block_to_hash)} blocks carry hashes"
        )
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_to_hash.get(block_id) == block_hash, (
                f"hash {block_hash[:12]} maps to block {block_id}, which carries "
                f"{self._block_to_hash.get(block_id)}"
            )
        assert self.enable_caching or not self._hash_to_block, "hashes with caching off"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has negative ref count {count}"
            cached = block_id in self._block_to_hash
            is_free = block_id in free_set or block_id in self._evictable
            assert is_free == (count == 0), (
                f"block {block_id}: ref count {count} but "
                f"{'in' if is_free else 'not in'} the free list"
            )
            if block_id in free_set:
                assert not cached, f"block {block_id} is on the free list but cached"
            if block_id in self._evictable:
                assert cached, f"block {block_id} is evictable but carries no hash"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")
