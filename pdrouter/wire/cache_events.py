"""What a prefill worker tells routers about its caches: block events and a snapshot.

    worker (workers/engine/block_events.py)        router (pdrouter/router/instances/
                                                    cache_events.py)
    GET /internal/cache/events?since=SEQ   ->      CacheEvents: the worker's epoch and the
                                                    events from SEQ on (gap: some were dropped)
    GET /internal/cache/snapshot           ->      CacheSnapshot: every block hash each tier
                                                    holds, the recent anchors, the next seq

An epoch names one run of a worker's engine: a restarted worker has a new one, and its
sequence numbers start again at 0. A router whose epoch differs, or whose SEQ the worker no
longer holds, reads the snapshot and continues with the events from its next_seq.

    stored    tier gained hashes         (device: a block registered in the prefix cache)
    removed   tier lost hashes           (device: evicted by an allocation)
    anchored  a prompt key fixes num_blocks leading blocks, the last named hashes[0]
              (pdrouter.wire.prompt_keys)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

CACHE_EVENTS_PATH = "/internal/cache/events"
CACHE_SNAPSHOT_PATH = "/internal/cache/snapshot"

EventKind = Literal["stored", "removed", "anchored"]
Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")


class CacheEvent(BaseModel):
    """One change; seq increases by one per event within an epoch."""

    model_config = ConfigDict(frozen=True)

    seq: int
    kind: EventKind
    tier: Tier = "device"
    hashes: list[str]
    key: str | None = None  # anchored only
    num_blocks: int = 0  # anchored only


class CacheEvents(BaseModel):
    """The answer to GET events?since=SEQ: events[0].seq == SEQ unless gap."""

    model_config = ConfigDict(frozen=True)

    epoch: str
    next_seq: int  # the seq the next event will have
    gap: bool  # SEQ is older than the oldest event held (or from the future): read the snapshot
    events: list[CacheEvent]


class Anchor(BaseModel):
    """A prompt key and the leading blocks it fixes (see CacheEvent's anchored)."""

    model_config = ConfigDict(frozen=True)

    key: str
    num_blocks: int
    last_hash: str


class CacheSnapshot(BaseModel):
    """Every hash each tier holds and the anchors kept, as of just before event next_seq."""

    model_config = ConfigDict(frozen=True)

    epoch: str
    next_seq: int
    tiers: dict[Tier, list[str]]
    anchors: list[Anchor]
