"""BlockPool: the KV cache's block allocator, with reference counts and a FIFO free list.

Plain ints, no Paddle: the pool hands out block ids; the runner's KV tensors are indexed by them.

Free order is deterministic so that tests can assert exact block ids:

    free list (front -> back):  [3, 4, 5, 0, 2]
    allocate(2) -> [3, 4]       taken from the front
    free([7, 1]) -> ... 5, 0, 2, 7, 1]
                                 a block whose count drops to 0 goes to the back, in the order
                                 of the ids passed to free()

Blocks that were just freed are therefore the last to be reused, which keeps a freed block's
stale KV around as long as possible (useful when reading logs and debugging a leak).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Reference-counted allocator over block ids [0, num_blocks)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first. For tests and debugging."""
        return list(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks blocks from the front of the free list, each with count 1.

        Returns None (and takes nothing) when fewer than num_blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"allocate() needs num_blocks >= 0, got {num_blocks}")
        if num_blocks > len(self._free_ids):
            return None
        block_ids = [self._free_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
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

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the back of the list.

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
                self._free_ids.append(block_id)

    def check_integrity(self) -> None:
        """Assert every block is free (count 0, listed once) xor referenced (count > 0)."""
        free_set = set(self._free_ids)
        assert len(free_set) == len(self._free_ids), (
            f"free list holds duplicates: {sorted(self._free_ids)}"
        )
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has negative ref count {count}"
            is_free = block_id in free_set
            assert is_free == (count == 0), (
                f"block {block_id}: ref count {count} but "
                f"{'in' if is_free else 'not in'} the free list"
            )

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")
