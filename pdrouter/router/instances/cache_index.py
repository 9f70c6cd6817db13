"""CacheIndex: which block hashes each P's cache tiers hold, as their events tell.

Fed only by the workers' own events (pdrouter/router/instances/cache_events.py polls them;
the wire shapes are pdrouter.wire.cache_events), never by guesses from what the router sent:
two router replicas that have read the same events hold the same index.

    per P      its epoch, the next seq it expects, the hashes of each tier
    anchors    prompt key -> (leading blocks it fixes, hash of the last), from every P (a key
               names content, not a place), the most recent MAX_ANCHORS kept
    apply      events in order from the expected seq; False (nothing applied) when the
               worker's epoch changed (it restarted), it reports a gap, or the events skip a
               seq: the caller then loads the worker's snapshot
    hit_blocks for a request's prompt keys, the most leading blocks of one of its anchors
               whose last block the P holds (in any tier)

Plain state, no I/O; the router's event loop is the only writer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdrouter.wire.cache_events import TIERS, Anchor, CacheEvent, CacheEvents, CacheSnapshot, Tier

MAX_ANCHORS = 65536


@dataclass
class PeerView:
    """What the router knows of one P's tiers."""

    epoch: str
    next_seq: int
    held: dict[Tier, set[str]] = field(default_factory=lambda: {tier: set() for tier in TIERS})

    def holds(self, block_hash: str) -> bool:
        return any(block_hash in hashes for hashes in self.held.values())


class CacheIndex:
    """Per-P block hashes and the prompt anchors, from events and snapshots."""

    def __init__(self, max_anchors: int = MAX_ANCHORS) -> None:
        self.views: dict[str, PeerView] = {}
        self.anchors: OrderedDict[str, Anchor] = OrderedDict()
        self.max_anchors = max_anchors
        self.num_snapshots = 0  # snapshots loaded (a restart or a gap each)

    def position(self, url: str) -> tuple[str, int] | None:
        """(epoch, next seq) the router expects from url; None before its first snapshot."""
        view = self.views.get(url)
        return None if view is None else (view.epoch, view.next_seq)

    def apply(self, url: str, answer: CacheEvents) -> bool:
        """Apply an events answer; False (nothing applied) when a snapshot is needed."""
        view = self.views.get(url)
        if view is None or answer.gap or answer.epoch != view.epoch:
            return False
        events = [e for e in answer.events if e.seq >= view.next_seq]
        if any(e.seq != view.next_seq + i for i, e in enumerate(events)):
            return False
        for event in events:
            self._apply_one(view, event)
        view.next_seq += len(events)
        return True

    def load(self, url: str, snapshot: CacheSnapshot) -> None:
        """Replace url's view by its snapshot; its anchors join the known ones."""
        view = PeerView(snapshot.epoch, snapshot.next_seq)
        for tier, hashes in snapshot.tiers.items():
            view.held[tier] = set(hashes)
        self.views[url] = view
        for anchor in snapshot.anchors:
            self._anchor(anchor)
        self.num_snapshots += 1

    def forget(self, url: str) -> None:
        """Drop url's view (it left the registry, or its cache is off)."""
        self.views.pop(url, None)

    def hit_blocks(self, url: str, keys: Sequence[str]) -> int:
        """Leading blocks of a prompt with these keys that url holds (0 when unknown)."""
        view = self.views.get(url)
        if view is None:
            return 0
        best = 0
        for key in keys:
            anchor = self.anchors.get(key)
            if anchor is not None and anchor.num_blocks > best and view.holds(anchor.last_hash):
                best = anchor.num_blocks
        return best

    def describe(self, url: str) -> dict[str, object]:
        """What /instances shows of url's view ({} before its first snapshot)."""
        view = self.views.get(url)
        if view is None:
            return {}
        counts = {f"{tier}_blocks": len(hashes) for tier, hashes in view.held.items()}
        return {"cache": {"epoch": view.epoch, "next_seq": view.next_seq, **counts}}

    def held(self, url: str, tier: Tier) -> set[str]:
        """A copy of the hashes url's tier holds (tests, /debug)."""
        view = self.views.get(url)
        return set() if view is None else set(view.held[tier])

    def _apply_one(self, view: PeerView, event: CacheEvent) -> None:
        if event.kind == "stored":
            view.held[event.tier].update(event.hashes)
        elif event.kind == "removed":
            view.held[event.tier].difference_update(event.hashes)
        elif event.key is not None and event.hashes:
            self._anchor(
                Anchor(key=event.key, num_blocks=event.num_blocks, last_hash=event.hashes[0])
            )

    def _anchor(self, anchor: Anchor) -> None:
        self.anchors[anchor.key] = anchor
        self.anchors.move_to_end(anchor.key)
        while len(self.anchors) > self.max_anchors:
            self.anchors.popitem(last=False)
