"""The router's admission queue: requests beyond --max-in-flight wait, most urgent first.

    enter(priority)   a slot free and nobody waiting   -> admitted at once
                      full, the queue below its bound  -> wait (heap: priority, then arrival)
                      full, the queue full             -> 429 (Admission's, as before)
                      waited --max-queue-wait-s         -> 429 naming the wait
    leave()           the slot goes to the most urgent waiter, else back to Admission

Off by default (--max-queued-requests 0): the router then keeps no queue and refuses at once,
as Admission says. A slot handed to a waiter never returns to Admission in between, so a
newcomer cannot take it first. Priority follows vLLM: a lower value is more urgent.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from pdrouter.router.selection.admission import Admission
from pdrouter.wire.errors import APIError


class AdmissionQueue:
    """Admission plus a bounded wait, served by priority."""

    def __init__(self, admission: Admission, max_queued: int, max_wait_s: float) -> None:
        self.admission = admission
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        # (priority, arrival number, future): the future's result is the slot
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self.num_waiting = 0

    async def enter(self, priority: int) -> None:
        """Hold one --max-in-flight slot (pair with leave()), waiting for it when the queue
        allows; raises Admission's 429 when it does not, or the wait's when it ran out."""
        limit = self.admission.cfg.max_in_flight
        full = limit is not None and self.admission.num_in_flight >= limit
        if not full:  # waiters exist only while it is full: a freed slot goes to one
            self.admission.enter()
            return
        if self.num_waiting >= self.max_queued:
            self.admission.enter()  # raises its 429 when full
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrivals), future))
        self.num_waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                self.leave()  # the slot came as the wait ended: hand it on
            else:
                future.cancel()
                self.num_waiting -= 1
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.admission.num_rejected += 1
            raise APIError(
                429,
                f"router overloaded: waited {self.max_wait_s:g} s in the admission queue "
                f"(--max-queue-wait-s) behind {self.num_waiting} requests; retry later",
                "rate_limit_error",
                code="overloaded",
                retry_after_s=self.admission.cfg.retry_after_s,
            ) from None

    def leave(self) -> None:
        """Give back a slot: to the most urgent waiter still waiting, else to Admission."""
        while self._heap:
            _, _, future = heapq.heappop(self._heap)
            if not future.cancelled():
                self.num_waiting -= 1
                future.set_result(None)  # the slot passes on: num_in_flight unchanged
                return
        self.admission.leave()
