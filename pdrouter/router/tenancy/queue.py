"""The router's admission queue: requests beyond --max-in-flight wait, most urgent first, and
urgent requests have slots of their own beyond it (--urgent-reserve).

    enter(priority)   a slot free for it and nobody waiting -> admitted at once
                      full for it, the queue below its bound -> wait (heap: priority, arrival)
                      full for it, the queue full            -> 429 (Admission's, as before)
                      waited --max-queue-wait-s               -> 429 naming the wait
    leave()           the slot goes to the most urgent waiter that may hold it, else back to
                      Admission

    slots  [ --max-in-flight: any priority ......... ][ --urgent-reserve: urgent only ]
           urgent: priority <= --urgent-priority

A request holds its slot for its whole stream, so without the reserve an urgent request
arriving while low-priority streams fill the limit would wait for one of them to end; with it,
up to --urgent-reserve urgent requests start at once (the engines then make room for them by
preempting less urgent work), and only beyond that do they wait, in front of every less urgent
waiter. Off by default (--max-queued-requests 0, --urgent-reserve 0): the router then keeps no
queue and refuses at once, as Admission says. A slot handed to a waiter never returns to
Admission in between, so a newcomer cannot take it first. Priority follows vLLM: a lower value
is more urgent.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from pdrouter.router.selection.admission import Admission
from pdrouter.wire.errors import APIError


class AdmissionQueue:
    """Admission plus a bounded wait, served by priority."""

    def __init__(
        self,
        admission: Admission,
        max_queued: int,
        max_wait_s: float,
        urgent_reserve: int = 0,
        urgent_priority: int = -1,
    ) -> None:
        self.admission = admission
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.urgent_reserve = urgent_reserve
        self.urgent_priority = urgent_priority
        # (priority, arrival number, future): the future's result is the slot
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self.num_waiting = 0

    async def enter(self, priority: int) -> None:
        """Hold one --max-in-flight slot (pair with leave()), waiting for it when the queue
        allows; raises Admission's 429 when it does not, or the wait's when it ran out."""
        extra = self.extra_slots(priority)
        if not self._full_for(priority, self.admission.num_in_flight):
            # A waiter exists only while every slot it may hold is taken: this one is free.
            self.admission.enter(extra)
            return
        if self.num_waiting >= self.max_queued:
            self.admission.enter(extra)  # raises its 429 when full
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
        """Give back a slot: to the most urgent waiter still waiting if it may hold it (the
        most urgent may hold any slot a less urgent one may), else to Admission."""
        while self._heap and self._heap[0][2].cancelled():
            heapq.heappop(self._heap)
        num_left = self.admission.num_in_flight - 1  # held once this slot is given back
        if self._heap and not self._full_for(self._heap[0][0], num_left):
            _, _, future = heapq.heappop(self._heap)
            self.num_waiting -= 1
            future.set_result(None)  # the slot passes on: num_in_flight unchanged
            return
        self.admission.leave()

    def extra_slots(self, priority: int) -> int:
        """Slots beyond --max-in-flight a request of priority may hold."""
        return self.urgent_reserve if priority <= self.urgent_priority else 0

    def _full_for(self, priority: int, num_in_flight: int) -> bool:
        limit = self.admission.cfg.max_in_flight
        return limit is not None and num_in_flight >= limit + self.extra_slots(priority)
