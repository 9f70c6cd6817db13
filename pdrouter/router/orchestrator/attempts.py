"""Attempts: one stage's tries of one request, across instances, with the failure policy.

Both stages run the same loop (orchestrator.prefill and orchestrator.decode), and each try is
one Attempt: the call's load held on the instance, the call guarded, the request sent, and one
breaker verdict when it ends.

    attempts = Attempts(hop, ctx)
    while (inst := await attempts.next()) is not None:   # a new instance, or one never reached
        with attempts.start(inst, load) as attempt:      # Hold + CallGuard; the verdict at exit
            async with attempt.send(payload) as resp:    # a transport error: attempt.failure
                ... attempt.succeed() or attempt.fail(failure) ...
        if attempt.failure is None: return ...
        await attempts.failed(inst, attempt.failure)     # a final answer raises; else metrics,
                                                         # mark down, timeline, backoff
    raise attempts.error()                               # failures.stage_error
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import TracebackType

import httpx

from pdrouter.router.instances.call_guard import CallGuard, GuardedCall
from pdrouter.router.instances.instance import Instance, Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.failures import Failure, stage_error, transport_failure
from pdrouter.router.selection.admission import Hold
from pdrouter.router.selection.policies import BreakerBusy
from pdrouter.router.selection.selector import Selector
from pdrouter.router.upstream.contract import HopTimeout, Upstream
from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import REQUEST_ID_HEADER


@dataclass(frozen=True)
class Hop:
    """One hop of the PD flow as every request makes it (router -> P, or router -> D): the
    role and path called, the call's bounds, how many instances a request may try, and the
    selection, registry, metrics and upstream client behind each call."""

    role: Role
    path: str
    timeout: HopTimeout
    max_attempts: int
    backoff_s: float
    selector: Selector
    registry: Registry
    metrics: RouterMetrics
    upstream: Upstream


class Attempt:
    """One call of a stage to one instance, as a with-block: the call's load is held on the
    instance (admission.Hold) and the call guarded (CallGuard: given up when the instance is
    found down) for the block's duration; at its end the instance's breaker gets exactly one
    verdict, the one the block gave (succeed(), or fail() with the failure's), none when the
    block gave none (the client left mid-call). A transport error (httpx.HTTPError) in the
    block ends it as the attempt's failure (failures.transport_failure) instead of
    propagating. A class, not a generator-based context manager: every call enters one."""

    __slots__ = ("_headers", "_hold", "failure", "guard", "hop", "inst", "ok", "verdict")

    def __init__(
        self, hop: Hop, inst: Instance, load: int, ctx: RequestContext, headers: dict[str, str]
    ) -> None:
        self.hop = hop
        self.inst = inst
        self._headers = headers
        self._hold = Hold(inst, load)
        self.guard = CallGuard(inst.calls, inst.url, ctx.task)
        self.failure: Failure | None = None
        self.ok = False
        self.verdict: bool | None = None  # the breaker's: True a failure, None none

    def __enter__(self) -> Attempt:
        self._hold.__enter__()
        self.guard.__enter__()
        return self

    def send(self, payload: bytes) -> GuardedCall:
        """POST payload to the instance: the answer's head once it arrives (guarded), the
        body read inside the block."""
        hop = self.hop
        url = self.inst.url + hop.path
        call = hop.upstream.request("POST", url, payload, self._headers, hop.timeout)
        return self.guard.entered(call)

    def succeed(self) -> None:
        self.ok = True
        self.verdict = False

    def fail(self, failure: Failure) -> None:
        self.failure = failure
        self.verdict = failure.breaker

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.guard.__exit__()
        self._hold.__exit__()
        transport = isinstance(exc, httpx.HTTPError)
        if transport:
            self.fail(transport_failure(exc))  # type: ignore[arg-type]
        self.hop.selector.verdict(self.inst, self.verdict)
        return transport


class Attempts:
    """The instances one request's stage has tried and how each attempt failed."""

    def __init__(self, hop: Hop, ctx: RequestContext) -> None:
        self.hop = hop
        self.ctx = ctx
        self.headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
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
        hop = self.hop
        if self.number + 1 >= hop.max_attempts:
            return None
        body = self.ctx.body if hop.role == "prefill" else None  # prompt-aware policies
        inst = self._prefetched() if self.number < 0 else None
        if inst is None:
            inst = await self._pick_waiting_for_trials(body)
        if inst is None and self.unreached:
            exclude = self.tried - self.unreached
            inst = hop.selector.pick(
                hop.role, exclude, body, self.ctx.cache_scope, self.ctx.priority or 0
            )
        if inst is None:
            return None
        self.number += 1
        if self.number:
            hop.metrics.retries.labels(hop.role).inc()
        self.tried.add(inst.url)
        return inst

    def _prefetched(self) -> Instance | None:
        """For a decode's first attempt, the D its prefetch went to (orchestrator.prefetch),
        when the selector would still give it and it did not refuse; else None."""
        prefetch = self.ctx.prefetch
        if self.hop.role != "decode" or prefetch is None or not prefetch.may_hold():
            return None
        decode = self.hop.registry.decode
        if not any(inst.url == prefetch.url and inst.healthy for inst in decode):
            return None  # gone, or down since: the usual pick prefers a healthy one
        others = {inst.url for inst in decode if inst.url != prefetch.url}
        try:
            return self.hop.selector.pick("decode", others, None, self.ctx.cache_scope)
        except APIError:  # its breaker is open, ...: the usual pick decides
            return None

    async def _pick_waiting_for_trials(self, body: bytes | None) -> Instance | None:
        selector = self.hop.selector
        breakers = selector.breakers
        deadline_s: float | None = None
        while True:
            try:
                return selector.pick(
                    self.hop.role, self.tried, body, self.ctx.cache_scope, self.ctx.priority or 0
                )
            except BreakerBusy:
                now_s = time.monotonic()
                if deadline_s is None:
                    deadline_s = now_s + breakers.cfg.trial_wait_s
                if now_s >= deadline_s or not await breakers.wait_for_change(deadline_s - now_s):
                    raise

    def start(self, inst: Instance, load: int) -> Attempt:
        """This request's attempt on inst, holding load (tokens) on it: a with-block."""
        headers = self.headers
        if self.ctx.trace is not None:  # traced: P or D parents its spans on the attempt's
            headers = self.ctx.trace.hop_headers(headers, self.hop.role, self.number)
        return Attempt(self.hop, inst, load, self.ctx, headers)

    async def failed(self, inst: Instance, failure: Failure, moved: str = "failed") -> None:
        """A failed attempt: its final answer raised (the client's 4xx, ...), else the
        attempt accounted, then a backoff before the next one. moved names the timeline
        event (the decode stage says whether it was a retry or a failover)."""
        if failure.final is not None:
            raise failure.final
        hop = self.hop
        self.failures.append((inst.url, failure))
        hop.metrics.stage_failures.labels(hop.role, failure.metric).inc()
        if not failure.reached:
            self.unreached.add(inst.url)
        if failure.marks_down:
            hop.registry.mark_down(inst, failure.reason)
        self.ctx.mark(f"{hop.role}_{moved}", url=inst.url, error=failure.reason)
        await asyncio.sleep(hop.backoff_s * (2**self.number))

    def error(self) -> APIError:
        """The client's error once no attempt is left (failures.stage_error)."""
        return stage_error(self.hop.role, self.failures)
