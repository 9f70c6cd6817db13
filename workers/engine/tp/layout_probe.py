"""Which other writer layouts (TP sizes) a worker asks the pool about, for the blocks its own
layout lacks.

A block may have been written by a worker of any TP size that divides the KV heads; asking
every size for every missing block costs up to 14 extra shard keys per block with 8 heads
(sizes 2, 4 and 8 beside one's own 1). A cluster holds one or two sizes, so LayoutProbe
remembers the sizes this worker has found blocks of and asks

    sizes found before      every key its own layout lacks
    every other size        only the first such key (one key's shards per size, per call)

A worker of a new size that joins is found the first time a call's first lacking block is
one it wrote (a D reading a request handed off from it: that is every block), and from then
on is asked in full. Until then its blocks further along count as absent: D recomputes them,
P writes them again in its own layout; nothing wrong is read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

# (TP size, logical key) pairs -> whether that layout holds every shard of the key (one exists()).
Complete = Callable[[Sequence[tuple[int, str]]], dict[tuple[int, str], bool]]


class LayoutProbe:
    def __init__(self, others: Sequence[int], complete: Complete) -> None:
        self.others = tuple(others)
        self._complete = complete
        self._lock = threading.Lock()  # handoffs of several requests probe at once
        self._seen: set[int] = set()

    @property
    def seen(self) -> frozenset[int]:
        """The other sizes this worker has found blocks of."""
        with self._lock:
            return frozenset(self._seen)

    def runs(self, lacking: Sequence[str]) -> dict[int, list[bool]]:
        """For each other size, which of `lacking` (non-empty) it holds whole."""
        seen = self.seen
        known = [t for t in self.others if t in seen]
        first = lacking[0]
        asked = [(t, k) for t in known for k in lacking]
        asked += [(t, first) for t in self.others if t not in seen]
        have = self._complete(asked)
        new = [t for t in self.others if t not in seen and have[(t, first)]]
        if new:
            with self._lock:
                self._seen.update(new)
            if len(lacking) > 1:
                have.update(self._complete([(t, k) for t in new for k in lacking[1:]]))
        return {t: [have.get((t, k), False) for k in lacking] for t in self.others}
