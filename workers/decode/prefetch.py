"""D starts with P: a request's prompt blocks reserved and read while P still computes.

    POST /internal/prefetch     (the router, beside P's /internal/prefill)
      prepare    template + tokenize the body on the CPU threads, the block keys under
                 the request's cache scope                                      else 400
      bound      reserved-but-waiting blocks + these <= --prefetch-max-fraction of
                 the KV cache (less urgent reservations released for the room, the least
                 urgent and newest first: their decodes allocate and load as usual), and the
                 blocks free now or freed by preempting running requests less urgent than
                 this one                                               else 503 prefetch_full
      follow     the worker's follower thread reads each key as P's write makes it
                 readable (workers/handoff/follower.py, the most urgent follow read first)
                 until the decode adopts it, the router
                 deletes it, or --prefetch-ttl-s passes                 -> 202 PrefetchAnswer
    POST /internal/decode       take(): the same request id, the same prompt tokens and
                 scope -> the follow is stopped (its copies waited for), the decode reads
                 only the keys it did not read; otherwise (none, or a mismatch) the usual
                 allocate + load
    DELETE /internal/prefetch/{request_id}   P failed, or the client left

A reservation's blocks are freed exactly once, after its follow thread has ended (a copy may
still write them): by release() (deleted, expired, mismatched) or by the decode that adopted
it (its own error paths free what it owns). A decode or delete that arrives while the
prefetch is still preparing marks the id abandoned, and the prefetch frees what it took as
soon as it has it. The bound keeps reservations from starving running decodes: they may take
at most that fraction of the cache, so the engine's running requests always have the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from pdrouter.wire.errors import unavailable
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import DecodeRequest, PrefetchAnswer, PrefetchRequest
from workers.decode import stages
from workers.handoff.follower import Follow, Follower
from workers.handoff.reader import ReadOutcome
from workers.handoff.tasks import wait_to_end
from workers.handoff.timings import ReadTimings
from workers.pool.keys import block_keys
from workers.server.pd_worker import PDSeam
from workers.server.prepare import check_model_name, prepare_request

log = logging.getLogger(__name__)
OUTCOMES = ("adopted", "cancelled", "displaced", "expired", "mismatched", "refused")
# Ids decoded or released before their prefetch came, remembered to refuse it.
MAX_ENDED_IDS = 4096


class PrefetchMetrics:
    """Reserved-but-waiting blocks and how each prefetch ended, on the worker's registry."""

    def __init__(self, registry: Any) -> None:
        self.reserved_blocks = Gauge(
            "pdworker_prefetch_reserved_blocks",
            "decode: KV blocks reserved by prefetches no decode has adopted yet",
            registry=registry,
        )
        self.outcomes = Counter(
            "pdworker_prefetch",
            "decode: prefetches by outcome (adopted by their decode, cancelled by the router "
            "or the decode's early arrival, displaced by a more urgent one, expired, "
            "mismatched tokens, refused)",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)
        self.blocks_ahead = Counter(
            "pdworker_prefetch_blocks_loaded_ahead",
            "decode: prompt KV blocks read from the pool before the decode arrived",
            registry=registry,
        )


@dataclass
class Reservation:
    """One request's reserved blocks and its follow of P's writes into them."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_scope: str | None
    keys: tuple[str, ...]
    block_ids: list[int]
    priority: int = 0  # the request's: its allocation, its follow's reads and its rest's
    follower: Follower | None = None
    follow: Follow | None = None
    expiry: asyncio.TimerHandle | None = None

    def matches(self, req: DecodeRequest) -> bool:
        return (
            tuple(req.prompt_token_ids) == self.prompt_token_ids
            and req.cache_scope == self.cache_scope
        )

    def halt(self) -> None:
        """Tell the follow to end (stopped() waits for it)."""
        if self.expiry is not None:
            self.expiry.cancel()
        if self.follower is not None and self.follow is not None:
            self.follower.stop(self.follow)

    async def stopped(self) -> ReadOutcome:
        """What the follow read, once it has ended (its copies completed); awaited to its end
        even if the caller is cancelled. A follow that failed read nothing usable."""
        self.halt()
        if self.follow is None:
            return ReadOutcome()
        try:
            return await wait_to_end(asyncio.wrap_future(self.follow.done))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # staging_full, a pool error: the decode reads it all
            log.warning("prefetch %s: follow failed: %s", self.request_id, exc)
            return ReadOutcome()


def prompt_token_ids(
    served_model_names: tuple[str, ...],
    tokenizer: Any,
    max_model_len: int,
    req: PrefetchRequest,
) -> tuple[tuple[int, ...], int]:
    """The prompt as P will tokenize it (the same body, template and rules; a CPU-thread
    helper), and the request's priority. P stays the tokenizer of record: the decode
    compares."""
    request_cls = ChatCompletionRequest if req.endpoint == "chat" else CompletionRequest
    parsed = parse_request(request_cls, json.dumps(req.body).encode())
    check_model_name(parsed.model, served_model_names)
    prepared = prepare_request(parsed, req.request_id, tokenizer, max_model_len)
    return prepared.prompt_token_ids, prepared.params.priority


class Prefetches:
    """D's reservations by request id (event-loop only; the follows run in threads)."""

    def __init__(self, registry: Any) -> None:
        self.metrics = PrefetchMetrics(registry)
        self._held: dict[str, Reservation] = {}
        self._preparing: set[str] = set()
        self._abandoned: set[str] = set()  # decoded or deleted while still preparing
        # Decoded or deleted before their prefetch arrived (the router sends it in a task of
        # its own, which a loaded event loop can run last): a late prefetch is refused rather
        # than held until its TTL. Bounded; the oldest forgotten first.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._num_reserved_blocks = 0  # held, preparing and not yet freed
        self._follower: Follower | None = None  # made with the first reservation

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved_blocks

    def _count_blocks(self, delta: int) -> None:
        self._num_reserved_blocks += delta
        self.metrics.reserved_blocks.set(self._num_reserved_blocks)

    def _refuse(self, why: str) -> None:
        self.metrics.outcomes.labels("refused").inc()
        raise unavailable(f"prefetch refused: {why}", "prefetch_full", 1)

    async def reserve(self, seam: PDSeam, req: PrefetchRequest) -> PrefetchAnswer:
        """Reserve the prompt's blocks and start following P's writes; 503 when over the
        bound, out of blocks or already held; 400 for a body P would refuse too."""
        rid = req.request_id
        if rid in self._held or rid in self._preparing:
            self._refuse(f"request id {rid!r} already has one")
        if rid in self._ended:
            del self._ended[rid]
            self._refuse(f"request id {rid!r} was decoded or released before its prefetch came")
        if not seam.open_pool().health().ok:  # it would poll a reconnecting pool in vain
            self._refuse("the KV pool client is reconnecting")
        identity = seam.identity
        self._preparing.add(rid)
        num_blocks = 0
        try:
            tokens, priority = await seam.cpu.run(
                prompt_token_ids,
                identity.served_model_names,
                seam.engine.tokenizer,
                identity.max_model_len,
                req,
            )
            keys = block_keys(
                identity.fingerprint, tokens, identity.block_size, scope=req.cache_scope
            )
            bound = int(seam.settings.prefetch_max_fraction * identity.num_kv_blocks)
            over = self._num_reserved_blocks + len(keys) - bound
            if over > 0:
                await self._displace(seam, priority, over)
            if self._num_reserved_blocks + len(keys) > bound:
                self._refuse(f"{self._num_reserved_blocks} of {bound} blocks reserved")
            num_blocks = len(keys)
            self._count_blocks(num_blocks)  # before the await: concurrent ones see it
            # By priority: running requests less urgent than it are preempted for the room.
            block_ids = await seam.engine.allocate_blocks(num_blocks, priority)
            if block_ids is None:
                self._refuse(f"no {num_blocks} free KV blocks")
        except BaseException:
            self._count_blocks(-num_blocks)
            self._preparing.discard(rid)
            self._abandoned.discard(rid)
            raise
        self._preparing.discard(rid)
        res = Reservation(rid, tokens, req.cache_scope, tuple(keys), block_ids, priority)
        if rid in self._abandoned:  # its decode or a delete came first
            self._abandoned.discard(rid)
            self._free(seam, res, "cancelled")
        else:
            self._start(seam, res)
        return PrefetchAnswer(
            request_id=rid, num_prompt_tokens=len(tokens), num_blocks_reserved=num_blocks
        )

    async def _displace(self, seam: PDSeam, priority: int, num_blocks: int) -> None:
        """Release held reservations less urgent than priority, the least urgent and newest
        first, until num_blocks are back or none is left (each once its follow ended)."""
        newest_first = reversed(list(self._held.values()))
        victims = sorted(newest_first, key=lambda res: res.priority, reverse=True)
        for res in victims:
            if num_blocks <= 0 or res.priority <= priority:
                return
            if self._held.get(res.request_id) is res:  # not taken meanwhile
                num_blocks -= len(res.block_ids)
                await self.release(seam, res.request_id, "displaced")

    def _remember_ended(self, request_id: str) -> None:
        self._ended[request_id] = None
        while len(self._ended) > MAX_ENDED_IDS:
            self._ended.popitem(last=False)

    def _start(self, seam: PDSeam, res: Reservation) -> None:
        settings = seam.settings
        if self._follower is None:  # one thread follows every reservation of this worker
            self._follower = Follower(
                seam.open_pool,
                seam.engine.kv_caches,
                group_blocks=settings.transfer_batch_blocks,
                wait_s=settings.wait_s,
                poll_s=settings.prefetch_poll_s,
            )
        deadline_s = time.monotonic() + settings.prefetch_ttl_s
        res.follower = self._follower
        res.follow = self._follower.add(res.keys, res.block_ids, deadline_s, res.priority)
        res.expiry = asyncio.get_running_loop().call_later(
            settings.prefetch_ttl_s, self._expire, seam, res.request_id
        )
        self._held[res.request_id] = res

    def _expire(self, seam: PDSeam, request_id: str) -> None:
        task = asyncio.ensure_future(self.release(seam, request_id, "expired"))
        seam.background.add(task)
        task.add_done_callback(seam.background.discard)

    def _free(self, seam: PDSeam, res: Reservation, outcome: str) -> None:
        with contextlib.suppress(Exception):  # a dead engine has no blocks to give back
            seam.engine.free_blocks(res.block_ids)
        self._count_blocks(-len(res.block_ids))
        self.metrics.outcomes.labels(outcome).inc()
        log.info("prefetch %s: %s", res.request_id, outcome)

    async def release(self, seam: PDSeam, request_id: str, outcome: str = "cancelled") -> bool:
        """Stop and free request_id's reservation; False when none is held (one still
        preparing is freed as soon as it has its blocks)."""
        res = self._held.pop(request_id, None)
        if res is None:
            if request_id in self._preparing:
                self._abandoned.add(request_id)
                return True
            self._remember_ended(request_id)
            return False
        try:
            await res.stopped()
        finally:
            self._free(seam, res, outcome)
        return True

    async def read_rest(
        self, seam: PDSeam, res: Reservation, keys: Sequence[str]
    ) -> tuple[ReadOutcome, int]:
        """An adopted reservation's prompt read: the follow stopped (its copies awaited), then
        the keys it did not read into the blocks after them; and how many it had read."""
        t_stop = time.monotonic()
        ahead = await res.stopped()
        stop_wait_s = time.monotonic() - t_stop
        n = ahead.num_loaded
        rest = await stages.load(seam, keys[n:], res.block_ids[n:], res.priority)
        self.metrics.blocks_ahead.inc(n)
        return loaded_total(ahead, rest, stop_wait_s), n

    def take(self, seam: PDSeam, req: DecodeRequest, keys: Sequence[str]) -> Reservation | None:
        """The reservation the decode of req (reading keys) adopts, its follow told to stop;
        the caller owns its blocks from now on. None: the decode allocates and loads as
        usual; a reservation for other tokens, another scope (mismatched) or a decode with
        nothing to load (cancelled) is released."""
        rid = req.request_id
        res = self._held.pop(rid, None)
        if res is None:
            if rid in self._preparing:
                self._abandoned.add(rid)
            else:
                self._remember_ended(rid)
            return None
        res.halt()
        if not keys or tuple(keys) != res.keys or not res.matches(req):
            if keys:
                log.warning("prefetch %s: D's tokens differ from P's; not used", rid)
            self._held[rid] = res
            outcome = "mismatched" if keys else "cancelled"
            task = asyncio.ensure_future(self.release(seam, rid, outcome))
            seam.background.add(task)
            task.add_done_callback(seam.background.discard)
            return None
        self._count_blocks(-len(res.block_ids))
        self.metrics.outcomes.labels("adopted").inc()
        return res


def loaded_total(ahead: ReadOutcome, rest: ReadOutcome, stop_wait_s: float) -> ReadOutcome:
    """The prompt's read as one outcome: the blocks and bytes the follow read, then the
    decode's; the timings only what the decode waited on (the follow's copies in flight when
    it stopped, counted as get, and its own read), the handoff left after P's answer."""
    return ReadOutcome(
        ahead.num_loaded + rest.num_loaded,
        rest.missing_keys,
        ahead.num_bytes + rest.num_bytes,
        rest.timings + ReadTimings(get_s=stop_wait_s),
    )
