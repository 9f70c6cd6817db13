"""Early decode: D starts with P instead of after it.

    enter     D picked now (healthy, breaker closed, room; the decode policy), and
              POST /internal/prefetch {request_id, endpoint, body, cache_scope} sent to it
              in a task of its own, beside P's prefill (never awaited before P)
    D         tokenizes, reserves the prompt's blocks, reads P's writes as they land
              (workers/decode/prefetch.py); 202, or 503 when it has no room
    decode    the decode stage tries that D first (Attempts(prefer=...)); its 200 means D
              adopted the reservation. A refused or failed prefetch changes nothing: the
              request goes the usual way, on any D
    local     a prompt estimated under --local-prefill-below-tokens gets none (D will
              prefill it itself); after P's LocalPrefill, D's decode without a KV handle
              releases the reservation itself
    end       unless that D answered the decode with 200, DELETE
              /internal/prefetch/{request_id} (after the POST's answer): P failed for good,
              the client left, the request ended after its first token, the decode went to
              another D. RouterService._end calls finish() once per request, so no path
              leaves a reservation behind; D's TTL bounds one whose DELETE is lost.

A P retried on another P writes the same keys (they depend only on the prompt), so the
reservation stays through P's retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdrouter.router.instances.instance import Instance
from pdrouter.router.observability.metrics import LoopCounter, RouterMetrics
from pdrouter.router.observability.trace import PREFETCH
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.prefetch_state import Prefetch
from pdrouter.router.selection.selector import Selector
from pdrouter.router.upstream.contract import HopTimeout, Upstream
from pdrouter.wire.pd import PREFETCH_PATH, REQUEST_ID_HEADER, PrefetchAnswer, prefill_request_json

log = logging.getLogger(__name__)
# How each prefetch went, as the router saw it.
OUTCOMES = ("accepted", "refused", "failed", "adopted", "released")
# D answers a prefetch after tokenizing and reserving blocks (between two engine steps).
PREFETCH_READ_S = 10.0


class EarlyDecode:
    """Starts each request's prefetch and ends it; built once per router."""

    def __init__(
        self,
        selector: Selector,
        upstream: Upstream,
        timeout: HopTimeout,
        metrics: RouterMetrics,
        local_prefill_below_tokens: int = 0,
    ) -> None:
        self.selector = selector
        # A prompt estimated shorter than this is all but surely prefilled by D itself
        # (conditional disaggregation): no prefetch for it.
        self.local_prefill_below_tokens = local_prefill_below_tokens
        self.upstream = upstream
        self.timeout = timeout
        self.outcomes = LoopCounter(
            "pdrouter_prefetch",
            "early decode prefetches by outcome: accepted or refused (503) by D, failed (no "
            "answer), adopted by the request's decode on that D, released by the router",
            metrics.registry,
            ("outcome",),
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)
        self._tasks: set[asyncio.Task[None]] = set()  # kept until done (never collected)

    def pick(self, ctx: RequestContext) -> Instance | None:
        """The D the request will decode on: a healthy one whose breaker is closed and that
        has room, by the decode policy; None (no prefetch) when there is none. No breaker
        trial slot is taken: the prefetch gives its D no verdict."""
        selector = self.selector
        candidates = selector.registry.healthy("decode")
        fingerprint = selector.registry.fingerprint
        if fingerprint is not None:
            candidates = [i for i in candidates if i.fingerprint in (None, fingerprint)]
        with_room = selector.admission.with_room(selector.breakers.available(candidates))
        if not with_room:
            return None
        return selector.policies["decode"].pick(with_room)

    def start(self, ctx: RequestContext) -> None:
        """Pick the request's D and send it the prefetch in the background."""
        if ctx.prompt_tokens_estimate < self.local_prefill_below_tokens:
            return
        plan = ctx.plan
        if plan is not None and not (plan.forks and plan.num_prompts == 1):
            # Its sub-requests (batched prompts, echo) decode under ids of their own, which
            # no reservation matches; only one prompt's group decodes as the request.
            return
        inst = self.pick(ctx)
        if inst is None:
            return
        prefetch = Prefetch(inst.url)
        ctx.prefetch = prefetch
        _mark(ctx, "prefetch_sent", url=inst.url)
        prefetch.sent = self._spawn(self._send(ctx, prefetch))

    def _spawn(self, work) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _send(self, ctx: RequestContext, prefetch: Prefetch) -> None:
        payload = prefill_request_json(ctx.request_id, ctx.endpoint, ctx.body, ctx.cache_scope)
        headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
        if ctx.trace is not None:  # traced: D's prefetch span joins the request's trace
            headers = ctx.trace.call_headers(headers, PREFETCH)
        url = prefetch.url + PREFETCH_PATH
        try:
            async with self.upstream.request("POST", url, payload, headers, self.timeout) as r:
                await r.read()
            if r.status_code == 202:
                answer = PrefetchAnswer.model_validate_json(r.content)
                prefetch.accepted = True
                _mark(ctx, "prefetch_answered", status=202, blocks=answer.num_blocks_reserved)
                self.outcomes.labels("accepted").inc()
            else:
                _mark(ctx, "prefetch_answered", status=r.status_code)
                self.outcomes.labels("refused").inc()
        except Exception as exc:  # D unreachable, slow, malformed: the usual order then
            log.info("request %s: prefetch on %s failed: %r", ctx.request_id, prefetch.url, exc)
            _mark(ctx, "prefetch_answered", status=0, error=type(exc).__name__)
            self.outcomes.labels("failed").inc()

    def finish(self, ctx: RequestContext) -> None:
        """The request ended: release its reservation unless its decode adopted it."""
        prefetch = ctx.prefetch
        if prefetch is None:
            return
        if prefetch.adopted:
            if prefetch.accepted:
                self.outcomes.labels("adopted").inc()
            return  # D's decode ended it (one still being made is freed when done)
        self._spawn(self._release(ctx.request_id, prefetch))

    async def _release(self, request_id: str, prefetch: Prefetch) -> None:
        if prefetch.sent is not None:
            with contextlib.suppress(BaseException):
                await prefetch.sent  # the POST answered first: no DELETE overtakes it
        if not prefetch.accepted:
            return
        url = f"{prefetch.url}{PREFETCH_PATH}/{request_id}"
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            async with self.upstream.request("DELETE", url, None, headers, self.timeout) as r:
                await r.read()
            self.outcomes.labels("released").inc()
        except Exception as exc:  # D's TTL frees it
            log.info("request %s: prefetch release on %s failed: %r", request_id, url, exc)

    async def aclose(self) -> None:
        """Wait for the prefetch calls still running (the router stops)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.timeout.connect_s)


def _mark(ctx: RequestContext, event: str, **detail: object) -> None:
    """A timeline mark unless the request has ended (its end stays the last event)."""
    if ctx.timeline is not None and ctx.timeline.status is None:
        ctx.timeline.mark(event, **detail)
