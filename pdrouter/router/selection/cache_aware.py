"""cache_aware: a prefill policy that scores each P by the request's prefix it holds and by
its load together.

With the pool as a shared prefix cache every P can read every block, so a device hit only
saves the pool read (or the host tier's copy); it must never pile a hot prefix onto one P.
What each P holds comes from its own events (CacheIndex, fed by
pdrouter/router/instances/cache_events.py), matched to the request through its prompt keys
(pdrouter.wire.prompt_keys: the router does not tokenize; P anchors keys to block hashes):

    hit(P)     leading blocks of the prompt P holds (CacheIndex.hit_blocks)
    fraction   hit(P) / max(the longest hit of any candidate, the prompt's estimated blocks)
    score(P)   fraction - load_weight * (in_flight(P) - the least in_flight of the candidates)
    choice     the highest score; ties: fewer requests in flight, fewer tokens in flight,
               then the URL (two replicas with the same index and loads choose alike)

With load_weight 0.25 a P holding the whole prompt wins over an idler P holding none of it
while it has fewer than four more requests in flight: a hot prefix spreads over every P as
their queues grow (each P that takes it caches it too). The skew bench sweeps the weight
(`make bench-cache-skew`: docs/benchmarks/cache_skew.md). The score only steers: a wrong
index costs a pool read or a recompute, never a wrong answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdrouter.common.flags import flag
from pdrouter.router.instances.cache_index import CacheIndex
from pdrouter.router.instances.instance import Instance
from pdrouter.wire.prompt_keys import chat_messages, prompt_keys

# The router's prompt estimate (as admission's): about 4 characters a token.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class CacheRoutingConfig:
    """How cache_aware weighs load against cached prefix, and how often it reads events."""

    load_weight: float = field(
        default=0.25,
        metadata=flag(
            "--cache-load-weight",
            "cache_aware: how much of a whole-prompt cache hit one more request in flight on "
            "a prefill instance (than on the idlest) outweighs",
        ),
    )
    events_interval_s: float = field(
        default=0.1,
        metadata=flag(
            "--cache-events-interval-s",
            "cache_aware: period of reading each prefill instance's cache events",
        ),
    )

    def __post_init__(self) -> None:
        if self.load_weight < 0 or self.events_interval_s <= 0:
            raise ValueError(f"cache routing needs load_weight >= 0 and interval > 0: {self}")


def estimated_blocks(doc: Any, block_size: int) -> int:
    """The prompt's blocks as the router estimates them from its characters."""
    if not isinstance(doc, dict):
        return 0
    messages = chat_messages(doc)
    if messages is not None:
        chars = sum(len(json.dumps(m.get("content"))) for m in messages)
    else:
        chars = len(json.dumps(doc.get("prompt")))
    return chars // CHARS_PER_TOKEN // max(1, block_size)


def load_key(inst: Instance) -> tuple[int, int, str]:
    return inst.in_flight, inst.in_flight_tokens, inst.url


class CacheAware:
    """Cached prefix fraction minus a load penalty (see the module doc)."""

    name = "cache_aware"

    def __init__(self, cfg: CacheRoutingConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else CacheRoutingConfig()
        self.index = CacheIndex()

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        """Without a prompt: the least loaded (ties: the URL)."""
        if not candidates:
            raise ValueError("CacheAware.pick needs at least one candidate")
        return min(candidates, key=load_key)

    def pick_for(
        self, candidates: Sequence[Instance], body: bytes, cache_scope: str | None = None
    ) -> Instance:
        """The candidate for a request of body under cache_scope (see the module doc)."""
        scores = self.scores(candidates, body, cache_scope)
        return min(candidates, key=lambda inst: (-scores[inst.url], *load_key(inst)))

    def scores(
        self, candidates: Sequence[Instance], body: bytes, cache_scope: str | None = None
    ) -> dict[str, float]:
        """Each candidate's score by URL."""
        if not candidates:
            raise ValueError("CacheAware.pick_for needs at least one candidate")
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        keys = prompt_keys(doc, cache_scope)
        hits = {inst.url: self.index.hit_blocks(inst.url, keys) for inst in candidates}
        block_size = next((i.block_size for i in candidates if i.block_size), 1)
        whole = max(1, *hits.values(), estimated_blocks(doc, block_size))
        least = min(inst.in_flight for inst in candidates)
        weight = self.cfg.load_weight
        return {
            inst.url: hits[inst.url] / whole - weight * (inst.in_flight - least)
            for inst in candidates
        }
