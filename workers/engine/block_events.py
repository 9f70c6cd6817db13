"""BlockEventLog: what a worker's cache tiers gained and lost, numbered, for routers to follow.

The device tier's BlockPool reports a block as stored when it is registered under its hash
and as removed when an allocation evicts it; a host tier reports through on_change(tier);
P adds anchors (pdrouter.wire.prompt_keys). Routers read the events from a sequence number on
(since) or, after a gap or a restart (a new epoch), the snapshot: the log keeps each tier's
current set of hashes from the events themselves, so a snapshot needs nothing from the tiers.

    seq      0, 1, 2, ... per event within one epoch (one run of the engine)
    buffer   the last events, at most max_events of them and max_hashes hashes in all (a
             worker nobody reads, e.g. a D, keeps a few MB); a reader further behind gets
             gap=True
    coalesce consecutive stored (or removed) hashes of one tier join the last event while no
             reader has been given it: a 4K-token prompt is one event, not 256, and an event
             a reader has seen never changes

Written from the engine thread, read from the server's event loop: one lock.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from pdrouter.wire.cache_events import (
    TIERS,
    Anchor,
    CacheEvent,
    CacheEvents,
    CacheSnapshot,
    EventKind,
    Tier,
)

MAX_EVENTS = 4096
MAX_BUFFERED_HASHES = 65536
MAX_ANCHORS = 8192
# A coalesced event holds at most this many hashes (a bounded answer per event).
MAX_HASHES_PER_EVENT = 512


class BlockEventLog:
    """Numbered cache events with a bounded buffer and the current state they add up to."""

    def __init__(
        self,
        max_events: int = MAX_EVENTS,
        max_anchors: int = MAX_ANCHORS,
        max_hashes: int = MAX_BUFFERED_HASHES,
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[CacheEvent] = deque()
        self._max_events, self._max_hashes = max_events, max_hashes
        self._num_hashes = 0  # in the buffered events
        self._next_seq = 0
        self._served_seq = -1  # events up to this seq have been read: never extended
        self._held: dict[Tier, set[str]] = {tier: set() for tier in TIERS}
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()
        self._max_anchors = max_anchors

    def stored(self, tier: Tier, hashes: Iterable[str]) -> None:
        """tier now holds hashes."""
        self._change("stored", tier, list(hashes))

    def removed(self, tier: Tier, hashes: Iterable[str]) -> None:
        """tier no longer holds hashes."""
        self._change("removed", tier, list(hashes))

    def on_change(self, tier: Tier) -> Callable[[Iterable[str], Iterable[str]], None]:
        """A tier's hook: on_change(tier)(added, removed)."""

        def changed(added: Iterable[str], removed: Iterable[str]) -> None:
            self.stored(tier, added)
            self.removed(tier, removed)

        return changed

    def anchored(self, key: str, num_blocks: int, last_hash: str) -> None:
        """Prompt key fixes num_blocks leading blocks, the last of them last_hash."""
        anchor = Anchor(key=key, num_blocks=num_blocks, last_hash=last_hash)
        with self._lock:
            if self._anchors.get(key) == anchor:
                self._anchors.move_to_end(key)
                return
            self._anchors[key] = anchor
            self._anchors.move_to_end(key)
            while len(self._anchors) > self._max_anchors:
                self._anchors.popitem(last=False)
            self._append(
                CacheEvent(
                    seq=self._next_seq,
                    kind="anchored",
                    hashes=[last_hash],
                    key=key,
                    num_blocks=num_blocks,
                )
            )

    def since(self, seq: int) -> CacheEvents:
        """The events from seq on, or gap=True when the buffer no longer starts at or before
        seq (or seq is beyond the next one)."""
        with self._lock:
            first = self._events[0].seq if self._events else self._next_seq
            gap = not first <= seq <= self._next_seq
            events = [] if gap else [e for e in self._events if e.seq >= seq]
            if events:
                self._served_seq = max(self._served_seq, events[-1].seq)
            return CacheEvents(epoch=self.epoch, next_seq=self._next_seq, gap=gap, events=events)

    def snapshot(self) -> CacheSnapshot:
        """Every tier's hashes (sorted) and the anchors, as of before event next_seq."""
        with self._lock:
            self._served_seq = self._next_seq - 1
            return CacheSnapshot(
                epoch=self.epoch,
                next_seq=self._next_seq,
                tiers={tier: sorted(held) for tier, held in self._held.items()},
                anchors=list(self._anchors.values()),
            )

    def held(self, tier: Tier) -> set[str]:
        """A copy of what tier holds now (tests and debugging)."""
        with self._lock:
            return set(self._held[tier])

    def _change(self, kind: EventKind, tier: Tier, hashes: list[str]) -> None:
        if not hashes:
            return
        with self._lock:
            held = self._held[tier]
            if kind == "stored":
                held.update(hashes)
            else:
                held.difference_update(hashes)
            last = self._events[-1] if self._events else None
            if (
                last is not None
                and last.seq > self._served_seq
                and last.kind == kind
                and last.tier == tier
                and len(last.hashes) + len(hashes) <= MAX_HASHES_PER_EVENT
            ):
                last.hashes.extend(hashes)  # unseen by any reader: still free to grow
                self._num_hashes += len(hashes)
                self._trim()
                return
            self._append(CacheEvent(seq=self._next_seq, kind=kind, tier=tier, hashes=hashes))

    def _append(self, event: CacheEvent) -> None:
        self._events.append(event)
        self._num_hashes += len(event.hashes)
        self._next_seq += 1
        self._trim()

    def _trim(self) -> None:
        while len(self._events) > 1 and (
            len(self._events) > self._max_events or self._num_hashes > self._max_hashes
        ):
            self._num_hashes -= len(self._events.popleft().hashes)
