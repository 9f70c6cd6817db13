"""cache_aware: a prefill policy that prefers the P whose device prefix cache likely holds the
request's prefix, without giving up load balance.

With the pool as a shared prefix cache every P can read every block, so affinity only saves
the pool read (device hit instead of pool hit); it must never pile requests on one P. The
router keeps, per P, an approximate prefix tree of the prompts it sent there: the prompt text
cut into fixed chunks, each named by a chained hash (chunk i's name covers chunks 0..i), in
an LRU map per instance (a flattened trie: a path exists iff its last chunk's name does).

    loads far apart?   max in flight - min in flight > imbalance_abs and
                       max > imbalance_ratio * min           -> least loaded (the fallback)
    otherwise          the candidate with the longest matched chunk run; ties and no match
                       at all -> least loaded
    then               the chosen P's tree learns the prompt's chunks

The chain starts from the request's cache scope (its tenant and cache_salt): prompts of two
scopes never match, so the routing of one tenant's request says nothing of another's prompts
(their blocks are never shared anyway). The prompt text is taken from the body (chat
messages' roles and contents, or the completion prompt), not the whole JSON: max_tokens and
the like change per turn. Plain ints and bytes, no worker code; approximate by design (the
router never learns of evictions).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdrouter.router.instances.instance import Instance

CHUNK_CHARS = 64
MAX_CHUNKS_PER_INSTANCE = 65536
IMBALANCE_ABS = 4
IMBALANCE_RATIO = 1.5


def prompt_text(body: bytes) -> str:
    """The part of an OpenAI body that becomes the prompt, in order ('' if none)."""
    try:
        doc: Any = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(doc, dict):
        return ""
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\x00{json.dumps(m.get('content'))}\x01")
        return "".join(parts)
    prompt = doc.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def chunk_names(
    text: str, chunk_chars: int = CHUNK_CHARS, cache_scope: str | None = None
) -> list[bytes]:
    """Chained names of text's full chunks: name i covers chunks 0..i (and the scope)."""
    names: list[bytes] = []
    parent = b"" if cache_scope is None else cache_scope.encode()
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[start : start + chunk_chars].encode(),
                                 digest_size=12).digest()  # fmt: skip
        names.append(parent)
    return names


class CacheAware:
    """Longest approximate prefix match among Ps whose loads are close; least loaded else."""

    name = "cache_aware"

    def __init__(
        self,
        imbalance_abs: int = IMBALANCE_ABS,
        imbalance_ratio: float = IMBALANCE_RATIO,
        max_chunks: int = MAX_CHUNKS_PER_INSTANCE,
    ) -> None:
        self.imbalance_abs = imbalance_abs
        self.imbalance_ratio = imbalance_ratio
        self.max_chunks = max_chunks
        self.trees: dict[str, OrderedDict[bytes, None]] = {}

    @staticmethod
    def _load(inst: Instance) -> tuple[int, int]:
        return inst.in_flight, inst.in_flight_tokens

    def pick(self, candidates: Sequence[Instance]) -> Instance:
        """Without a prompt: the least loaded."""
        if not candidates:
            raise ValueError("CacheAware.pick needs at least one candidate")
        return min(candidates, key=self._load)

    def pick_for(
        self, candidates: Sequence[Instance], body: bytes, cache_scope: str | None = None
    ) -> Instance:
        """The candidate for a request of body under cache_scope (see the module doc); learns
        its choice."""
        least = self.pick(candidates)
        names = chunk_names(prompt_text(body), cache_scope=cache_scope)
        loads = [inst.in_flight for inst in candidates]
        hi, lo = max(loads), min(loads)
        balanced = hi - lo <= self.imbalance_abs or hi <= self.imbalance_ratio * lo
        chosen = least
        if balanced and names:

            def preference(inst: Instance) -> tuple[int, int, int]:
                return self.match(inst.url, names), -inst.in_flight, -inst.in_flight_tokens

            best = max(candidates, key=preference)
            if self.match(best.url, names) > 0:
                chosen = best
        self.learn(chosen.url, names)
        return chosen

    def match(self, url: str, names: Sequence[bytes]) -> int:
        """How many leading chunks of names url's tree holds."""
        tree = self.trees.get(url)
        if not tree:
            return 0
        n = 0
        for name in names:
            if name not in tree:
                break
            n += 1
        return n

    def learn(self, url: str, names: Sequence[bytes]) -> None:
        tree = self.trees.setdefault(url, OrderedDict())
        for name in names:
            tree[name] = None
            tree.move_to_end(name)
        while len(tree) > self.max_chunks:
            tree.popitem(last=False)
