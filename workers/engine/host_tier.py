"""HostTier: KV blocks in host memory, between the device prefix cache and the pool.

An entry is one full block's KV under its chained block hash (the device cache's and the pool
keys' name for it), in a slot of a block-major host buffer: the layout swap_cache_layout
copies to and from, so a write is one D2H call and a swap-in one H2D call for many blocks.

    device event          write policy (workers/engine/host_policy.py)
    registered            write_through: pending
    served as a hit       write_through_selective: pending once served threshold times
    evicted from device   write_back: pending; every policy: pending copies done now, before
                          allocate() hands the block out (its KV is still intact then)
    end of an engine step pending copies done (one D2H call)

A hash is in the tier once its copy completed (flush commits entries after the copy's wait),
so a lookup never finds a slot still being written. A swap-in (start_read ... finish_read)
pins its entries until it has landed: eviction skips pinned entries, so neither a write-back
triggered by the swap-in's own allocation nor a later step's write reuses a slot being read.
The tier's state is the engine thread's; only the copies run beside it.

on_change(added_hashes, removed_hashes) is called on the engine thread after each change (it
must not block), for the router's view of where the blocks are; set at construction or
assigned later (the attribute), a no-op by default.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.host_policy import HostEviction, HostTierConfig, LRUEviction, WritePolicy

log = logging.getLogger(__name__)
MODE_D2H, MODE_H2D = 0, 1
BlockRef = tuple[int, str]  # (device block id, block hash)
OnChange = Callable[[tuple[str, ...], tuple[str, ...]], None]


def no_change(added_hashes: tuple[str, ...], removed_hashes: tuple[str, ...]) -> None:
    """The default on_change: nobody listens."""


class CopyHandle(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None:
        """Returns once every byte landed; raises what the copy raised."""
        ...


class HostCopier(Protocol):
    """Copies blocks between the device cache and host slots: copy() returns once they
    landed; start() returns at once (the copy runs beside the engine's steps)."""

    slot_bytes: int

    def copy(self, block_ids: list[int], slots: list[int], mode: int) -> None: ...

    def start(self, block_ids: list[int], slots: list[int], mode: int) -> CopyHandle: ...


@dataclass(frozen=True)
class PendingRead:
    """A swap-in under way: its entries pinned, its device blocks written until handle is
    done (neither may be read nor reused before finish_read)."""

    hashes: tuple[str, ...]
    block_ids: tuple[int, ...]
    handle: CopyHandle


@dataclass(frozen=True)
class HostTierStats:
    """Counters since start (blocks and bytes), for /metrics."""

    write_policy: WritePolicy
    num_slots: int
    num_used: int
    slot_bytes: int
    blocks_written: int
    bytes_written: int
    blocks_read: int  # host hits swapped into the device
    bytes_read: int
    evictions: int
    writes_skipped: int  # no slot: every entry pinned, or the copy failed


class HostTier:
    """The host tier of one engine (see the module doc)."""

    def __init__(
        self,
        config: HostTierConfig,
        copier: HostCopier,
        eviction: HostEviction | None = None,
        on_change: OnChange = no_change,
    ) -> None:
        self.config = config
        self._copier = copier
        self._eviction = eviction if eviction is not None else LRUEviction()
        self.on_change = on_change
        self._free_slots: deque[int] = deque(range(config.num_slots))
        self._hash_to_slot: dict[str, int] = {}
        self._pins: dict[str, int] = {}  # hash -> copies reading it
        self._pending: dict[str, int] = {}  # hash -> device block to copy at the next flush
        self._hits: dict[str, int] = {}  # selective: device hits of blocks not yet here
        self._counts = dict.fromkeys(("written", "read", "evictions", "skipped"), 0)

    # ---- queries ----------------------------------------------------------------------

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._hash_to_slot

    def run_length(self, hashes: Iterable[str]) -> int:
        """How many of hashes, from the first, are here."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self._hash_to_slot:
                break
            n += 1
        return n

    def entries(self) -> dict[str, int]:
        """hash -> slot, in insertion order. For tests and debugging."""
        return dict(self._hash_to_slot)

    def pending(self) -> dict[str, int]:
        """hash -> device block of the copies the next flush makes. For tests."""
        return dict(self._pending)

    def stats(self) -> HostTierStats:
        c, slot_bytes = self._counts, self._copier.slot_bytes
        return HostTierStats(
            self.config.write_policy,
            self.config.num_slots,
            len(self._hash_to_slot),
            slot_bytes,
            c["written"],
            c["written"] * slot_bytes,
            c["read"],
            c["read"] * slot_bytes,
            c["evictions"],
            c["skipped"],
        )

    # ---- device events (write policy) -------------------------------------------------

    def on_registered(self, refs: Iterable[BlockRef]) -> None:
        """Blocks whose KV is complete on the device."""
        if self.config.write_policy == "write_through":
            for block_id, block_hash in refs:
                if block_hash not in self._hash_to_slot:
                    self._pending[block_hash] = block_id

    def on_device_hits(self, refs: Iterable[BlockRef]) -> None:
        """Device blocks a request took as its cached prefix."""
        selective = self.config.write_policy == "write_through_selective"
        for block_id, block_hash in refs:
            if block_hash in self._hash_to_slot:
                self._eviction.used(block_hash)
            elif selective:
                hits = self._hits.get(block_hash, 0) + 1
                self._hits[block_hash] = hits
                if hits >= self.config.write_through_threshold:
                    self._pending[block_hash] = block_id

    def on_device_evict(self, refs: Sequence[BlockRef]) -> None:
        """Device blocks about to be handed out again: what must be copied is copied now."""
        for _, block_hash in refs:
            self._hits.pop(block_hash, None)
        if self.config.write_policy == "write_back":
            for block_id, block_hash in refs:
                if block_hash not in self._hash_to_slot:
                    self._pending[block_hash] = block_id
        self.flush()

    def flush(self) -> None:
        """Make the pending copies (one D2H call), then list them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        refs = [(b, h) for h, b in pending.items() if h not in self._hash_to_slot]
        slots: list[int] = []
        removed: list[str] = []
        for _ in refs:
            slot = self._take_slot(removed)
            if slot is None:
                break
            slots.append(slot)
        self._counts["skipped"] += len(refs) - len(slots)
        refs = refs[: len(slots)]
        try:
            if refs:
                self._copier.copy([b for b, _ in refs], slots, MODE_D2H)
        except Exception as exc:  # a lost host copy is a miss later, never a failed step
            log.warning("host tier write of %d blocks failed: %r", len(refs), exc)
            self._free_slots.extend(slots)
            self._counts["skipped"] += len(refs)
            refs = []
        for (_, block_hash), slot in zip(refs, slots, strict=False):
            self._hash_to_slot[block_hash] = slot
            self._eviction.added(block_hash)
            self._hits.pop(block_hash, None)
        self._counts["written"] += len(refs)
        if refs or removed:
            self.on_change(tuple(h for _, h in refs), tuple(removed))

    # ---- swap-in ----------------------------------------------------------------------

    def read(self, hashes: Sequence[str], block_ids: Sequence[int]) -> None:
        """Copy the entries of hashes into device block_ids and wait: start_read, then
        finish_read."""
        self.finish_read(self.start_read(hashes, block_ids))

    def start_read(self, hashes: Sequence[str], block_ids: Sequence[int]) -> PendingRead:
        """Start copying the entries of hashes into device block_ids (one H2D call); they
        stay pinned until finish_read. KeyError for a hash not here (nothing started)."""
        slots = [self._hash_to_slot[h] for h in hashes]
        self.pin(hashes)
        try:
            handle = self._copier.start(list(block_ids), slots, MODE_H2D)
        except BaseException:
            self.unpin(hashes)
            raise
        return PendingRead(tuple(hashes), tuple(block_ids), handle)

    def finish_read(self, pending: PendingRead) -> None:
        """Wait for a started read and unpin its entries; raises what the copy raised."""
        try:
            pending.handle.wait()
        finally:
            self.unpin(pending.hashes)
        for block_hash in pending.hashes:
            self._eviction.used(block_hash)
        self._counts["read"] += len(pending.hashes)

    def pin(self, hashes: Iterable[str]) -> None:
        """Keep hashes from eviction until unpin (each must be here)."""
        hashes = list(hashes)
        missing = [h[:12] for h in hashes if h not in self._hash_to_slot]
        if missing:
            raise KeyError(f"pin() of hashes not in the host tier: {missing}")
        for block_hash in hashes:
            self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, hashes: Iterable[str]) -> None:
        for block_hash in hashes:
            count = self._pins[block_hash] - 1
            if count:
                self._pins[block_hash] = count
            else:
                del self._pins[block_hash]

    # ---- helpers ----------------------------------------------------------------------

    def _take_slot(self, removed: list[str]) -> int | None:
        """A free slot, evicting an unpinned entry if none is; None if every entry is pinned."""
        if self._free_slots:
            return self._free_slots.popleft()
        victim = self._eviction.victim(set(self._pins))
        if victim is None:
            return None
        self._eviction.removed(victim)
        removed.append(victim)
        self._counts["evictions"] += 1
        return self._hash_to_slot.pop(victim)

    def check_integrity(self) -> None:
        """Assert slots are each free xor held by one entry, and pins name entries."""
        held = list(self._hash_to_slot.values())
        assert len(set(held)) == len(held), f"a slot holds two entries: {sorted(held)}"
        both = set(held) & set(self._free_slots)
        assert not both, f"slots {sorted(both)} are both free and held"
        assert len(held) + len(self._free_slots) == self.config.num_slots, "slots lost"
        stray = [h[:12] for h in self._pins if h not in self._hash_to_slot]
        assert not stray, f"pins on entries not here: {stray}"
