"""The host tier's two policies: when a device block is copied to host memory (the write
policy) and which host entry leaves when a slot is needed (the eviction policy).

Write policies, named as FastDeploy's Cache Manager names them:

    write_through            a block is copied as soon as it is complete (registered in the
                             device cache: computed, or loaded from the pool or a handoff)
    write_through_selective  only once the device cache has served it threshold times (a
                             block nobody asks for twice never costs host bandwidth)
    write_back               only when the device evicts it (the last moment its KV exists)

Eviction: least recently used (written or read) first; a pinned entry (a copy reads it) is
never chosen. Another policy implements HostEviction.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class HostTierConfig:
    """The tier's size in blocks and its write policy (from EngineConfig's flags)."""

    num_slots: int
    write_policy: WritePolicy = "write_through_selective"
    write_through_threshold: int = 2  # device hits before a selective copy

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"a host tier needs at least 1 slot, got {self.num_slots}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write policy {self.write_policy!r} is not one of {', '.join(WRITE_POLICIES)}"
            )
        if self.write_through_threshold < 1:
            raise ValueError(
                f"write_through_threshold must be >= 1, got {self.write_through_threshold}"
            )


class HostEviction(Protocol):
    """Orders the host tier's entries for eviction; the tier tells it every use."""

    def added(self, block_hash: str) -> None: ...

    def used(self, block_hash: str) -> None: ...

    def removed(self, block_hash: str) -> None: ...

    def victim(self, pinned: set[str]) -> str | None:
        """The entry to evict next, never one in pinned; None if every entry is pinned."""
        ...


class LRUEviction:
    """Least recently added or used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # LRU first

    def added(self, block_hash: str) -> None:
        self._order[block_hash] = None

    def used(self, block_hash: str) -> None:
        self._order.move_to_end(block_hash)

    def removed(self, block_hash: str) -> None:
        del self._order[block_hash]

    def victim(self, pinned: set[str]) -> str | None:
        return next((h for h in self._order if h not in pinned), None)

    def order(self) -> list[str]:
        """LRU first. For tests."""
        return list(self._order)
