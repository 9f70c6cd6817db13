"""Attempts: one stage's tries of one request, across instances, with the failure policy.

Both stages run the same loop (orchestrator.prefill and orchestrator.decode):

    while (inst := await attempts.next()) is not None:     # a new instance, or one never reached
        ... call inst ...                            # success: return
        attempts.failed(inst, failure)               # metrics, mark down, timeline, backoff
    raise attempts.error()                           # failures.stage_error
"""

from __future__ import annotations

import asyncio
import time

from pdrouter.router.instances.instance import Instance, Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.failures import Failure, stage_error
from pdrouter.router.selection.policies import BreakerBusy
from pdrouter.router.selection.selector import Selector
from pdrouter.wire.errors import APIError


class Attempts:
    """The instances one request's stage has tried and how each attempt failed."""

    def __init__(
        self,
        role: Role,
        ctx: RequestContext,
        selector: Selector,
        registry: Registry,
        metrics: RouterMetrics,
        max_attempts: int,
        backoff_s: float,
    ) -> None:
        self.role = role
        self.ctx = ctx
        self.selector = selector
        self.registry = registry
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.number = -1  # the current attempt, from 0
        self.tried: set[str] = set()
        self.unreached: set[str] = set()  # tried, but the call never got to the instance
        self.failures: list[tuple[str, Failure]] = []

    async def next(self) -> Instance | None:
        """The next attempt's instance: one not tried yet, else one the request never reached
        (a connect or pool timeout: under load often the router's own stall, not the
        instance), while attempts last; None when none is left. When every breaker refuses
        but a trial slot should free soon, waits for it (bounded: BreakerConfig.trial_wait_s)
        before the 503."""
        if self.number + 1 >= self.max_attempts:
            return None
        body = self.ctx.body if self.role == "prefill" else None  # prompt-aware policies
        inst = await self._pick_waiting_for_trials(body)
        if inst is None and self.unreached:
            inst = self.selector.pick(self.role, self.tried - self.unreached, body)
        if inst is None:
            return None
        self.number += 1
        if self.number:
            self.metrics.retries.labels(self.role).inc()
        self.tried.add(inst.url)
        return inst

    async def _pick_waiting_for_trials(self, body: bytes | None) -> Instance | None:
        breakers = self.selector.breakers
        deadline_s: float | None = None
        while True:
            try:
                return self.selector.pick(self.role, self.tried, body)
            except BreakerBusy:
                now_s = time.monotonic()
                if deadline_s is None:
                    deadline_s = now_s + breakers.cfg.trial_wait_s
                if now_s >= deadline_s or not await breakers.wait_for_change(deadline_s - now_s):
                    raise

    async def failed(self, inst: Instance, failure: Failure, moved: str = "failed") -> None:
        """Account one failed attempt, then back off before the next one. moved names the
        timeline event (the decode stage says whether it was a retry or a failover)."""
        self.failures.append((inst.url, failure))
        self.metrics.stage_failures.labels(self.role, failure.metric).inc()
        if not failure.reached:
            self.unreached.add(inst.url)
        if failure.marks_down:
            self.registry.mark_down(inst, failure.reason)
        self.ctx.mark(f"{self.role}_{moved}", url=inst.url, error=failure.reason)
        await asyncio.sleep(self.backoff_s * (2**self.number))

    def error(self) -> APIError:
        """The client's error once no attempt is left (failures.stage_error)."""
        return stage_error(self.role, self.failures)
