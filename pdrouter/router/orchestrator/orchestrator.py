"""The PD flow as a service: prefill on a P (with failover), then decode on a D (relayed).

    client ─► router ─► P  POST /internal/prefill   retried on another P before its result
                    ◄── PrefillResult (first token, KV handle)
             ◄─ first token (stream: at once)
                    ─► D  POST /internal/decode     another D if one cannot be reached;
                    ◄── DecodeEvent stream           resumed on another D if it dies mid-stream
             ◄─ relayed tokens, usage = prompt side from P + completion side from D

One room per part: the stages (prefill.py, decode.py) share the failure policy (failures.py)
and the attempt loop (attempts.py); answer.py builds what the client gets. The app's service
(pdrouter.router.service) stays thin: it parses and calls prefill(), then stream() or
complete().
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdrouter.router.instances.instance import Instance, Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.answer import Answers
from pdrouter.router.orchestrator.config import OrchestratorConfig
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.hops import Hops
from pdrouter.router.orchestrator.prefill import prefill as prefill_stage
from pdrouter.router.selection.admission import Admission, AdmissionConfig
from pdrouter.router.selection.breaker import BreakerBoard, BreakerConfig
from pdrouter.router.selection.policies import SelectionPolicy
from pdrouter.router.selection.selector import Selector
from pdrouter.router.upstream.contract import Upstream
from pdrouter.wire.pd import PrefillResult


class Orchestrator:
    """Runs requests through P then D; owns no sockets (the app passes its Upstream)."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        registry: Registry,
        prefill_policy: SelectionPolicy,
        decode_policy: SelectionPolicy,
        metrics: RouterMetrics,
        upstream: Upstream,
        breakers: BreakerBoard | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.metrics = metrics
        self.selector = Selector(
            registry,
            self.policies,
            breakers if breakers is not None else BreakerBoard(BreakerConfig()),
            admission if admission is not None else Admission(AdmissionConfig()),
        )
        self.hops = Hops(cfg, registry, self.selector, metrics, upstream)
        self.answers = Answers(self.hops)

    @property
    def upstream(self) -> Upstream:
        return self.hops.upstream

    @upstream.setter
    def upstream(self, upstream: Upstream) -> None:
        self.hops.upstream = upstream

    def pick(self, role: Role, exclude: set[str]) -> Instance | None:
        """The instance the next attempt goes to (see selection.selector.Selector.pick)."""
        return self.selector.pick(role, exclude)

    def ensure_room(self, role: Role) -> None:
        self.selector.ensure_room(role)

    async def prefill(self, ctx: RequestContext) -> PrefillResult:
        """P's result, retried on other P instances after a failure before the result."""
        return await prefill_stage(self.hops, ctx)

    def stream(self, ctx: RequestContext, result: PrefillResult) -> AsyncIterator[bytes]:
        """SSE bytes for a streaming client: P's first token at once, then D's relayed."""
        return self.answers.stream(ctx, result)

    async def complete(self, ctx: RequestContext, result: PrefillResult) -> dict[str, Any]:
        """The whole non-streamed response."""
        return await self.answers.complete(ctx, result)
