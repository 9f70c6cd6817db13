"""Prompt anchors: P tells routers which leading blocks a few of a prompt's keys fix.

A router names prompt prefixes by keys it computes from the body (pdrouter.wire.prompt_keys);
only P, the tokenizer of record, can tie a key to block hashes. After tokenizing a prefill
request P renders the prefix a key names, tokenizes it, and counts the tokens it shares with
the whole prompt, less one (the last token of a prefix may merge with what follows it in
another prompt): the full blocks within them are fixed by the key, whatever follows. An
anchor is (key, number of those blocks, hash of the last), published in the block event log.

    chat        keys of the first message (a system prompt), of all messages but the last
                (the conversation before this turn) and of all messages (the next turn's
                conversation before its own turn)
    completion  keys ending at 256, 512, 1024, ... characters and the last full chunk

At most a handful of extra tokenizations of prefixes, on a thread of their own beside the
prefill (never before it): the anchors are hints, a failure here is logged and changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdrouter.wire.pd import PrefillRequest
from pdrouter.wire.prompt_keys import CHUNK_CHARS, chat_messages, prompt_keys, template_role
from workers.engine.block_events import BlockEventLog
from workers.pool.keys import block_hashes

if TYPE_CHECKING:
    from workers.prefill.stages import PrefillPlan
    from workers.server.pd_worker import PDSeam

log = logging.getLogger(__name__)

FIRST_ANCHOR_CHARS = 256


def _chat_points(messages: list[dict[str, Any]]) -> list[int]:
    n = len(messages)
    return sorted({i for i in (0, n - 2, n - 1) if 0 <= i < n})


def _text_points(num_keys: int) -> list[int]:
    points, chars = {num_keys - 1}, FIRST_ANCHOR_CHARS
    while chars // CHUNK_CHARS <= num_keys:
        points.add(chars // CHUNK_CHARS - 1)
        chars *= 2
    return sorted(p for p in points if p >= 0)


def _prefix_ids(tokenizer: Any, doc: dict[str, Any], index: int) -> list[int]:
    """Token ids of the prefix key index names."""
    messages = chat_messages(doc)
    if messages is not None:
        flat = [
            {"role": template_role(m), "content": m.get("content") or ""}
            for m in messages[: index + 1]
        ]
        text = tokenizer.apply_chat_template(flat, add_generation_prompt=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prefix = doc["prompt"][: (index + 1) * CHUNK_CHARS]
    return list(tokenizer.encode(prefix, add_special_tokens=True))


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def anchors_of(
    tokenizer: Any,
    doc: dict[str, Any],
    prompt_ids: Sequence[int],
    fingerprint: str,
    block_size: int,
    scope: str | None,
) -> list[tuple[str, int, str]]:
    """(key, num_blocks, last block hash) for the anchor points of a prompt (module doc)."""
    keys = prompt_keys(doc, scope)
    if not keys:
        return []
    messages = chat_messages(doc)
    points = _chat_points(messages) if messages is not None else _text_points(len(keys))
    counts = []
    for index in points:
        stable = _shared(_prefix_ids(tokenizer, doc, index), prompt_ids) - 1
        counts.append((index, max(0, stable) // block_size))
    most = max(n for _, n in counts)
    if most == 0:
        return []
    hashes = block_hashes(fingerprint, list(prompt_ids[: most * block_size]), block_size, scope)
    return [(keys[index], n, hashes[n - 1]) for index, n in counts if n > 0]


def publish(
    events: BlockEventLog,
    tokenizer: Any,
    req: PrefillRequest,
    prompt_ids: Sequence[int],
    fingerprint: str,
    block_size: int,
) -> None:
    """Compute and log a prompt's anchors (a CPU-thread helper; never raises)."""
    try:
        anchors = anchors_of(
            tokenizer, req.body, prompt_ids, fingerprint, block_size, req.cache_scope
        )
    except Exception:  # a hint: the request goes on whatever happens here
        log.exception("prompt anchors of %s failed", req.request_id)
        return
    for key, num_blocks, last_hash in anchors:
        events.anchored(key, num_blocks, last_hash)


class AnchorThread:
    """One thread of its own for anchors, so that they never delay a request's own
    tokenization on the CPU threads; past MAX_PENDING queued prompts new ones are dropped
    (hints: a prompt without anchors is still served, its prefix found on a later turn)."""

    MAX_PENDING = 32

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prompt-anchors")
        self._lock = threading.Lock()  # the counts: taken on the event loop, given back here
        self.num_pending = 0
        self.num_dropped = 0

    def submit(self, seam: PDSeam, req: PrefillRequest, plan: PrefillPlan) -> None:
        """publish() a prefill request's anchors (nothing with prefix caching off)."""
        events = seam.engine.block_events
        if events is None:
            return
        with self._lock:
            if self.num_pending >= self.MAX_PENDING:
                self.num_dropped += 1
                return
            self.num_pending += 1
        ids, identity = plan.prepared.prompt_token_ids, seam.identity
        future = self._pool.submit(
            publish,
            events,
            seam.engine.tokenizer,
            req,
            ids,
            identity.fingerprint,
            identity.block_size,
        )
        future.add_done_callback(self._done)

    def _done(self, _: object) -> None:
        with self._lock:
            self.num_pending -= 1


ANCHORS = AnchorThread()


def publish_soon(seam: PDSeam, req: PrefillRequest, plan: PrefillPlan) -> None:
    """The process's AnchorThread takes the request's anchors."""
    ANCHORS.submit(seam, req, plan)
