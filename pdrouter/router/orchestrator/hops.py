"""Hops: what both stages use to call workers, shared by the orchestrator and its stages."""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.router.instances.instance import Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.attempts import Attempts
from pdrouter.router.orchestrator.config import OrchestratorConfig
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.selection.selector import Selector
from pdrouter.router.upstream.contract import HopTimeout, Upstream


@dataclass
class Hops:
    """The registry, selection, metrics and upstream client behind every call to a worker
    (upstream is replaceable: the path benchmark swaps in a scripted one)."""

    cfg: OrchestratorConfig
    registry: Registry
    selector: Selector
    metrics: RouterMetrics
    upstream: Upstream

    def __post_init__(self) -> None:
        t = self.cfg.timeouts
        self.prefill_timeout = HopTimeout(t.connect_s, t.prefill_s, t.write_s)
        self.decode_timeout = HopTimeout(t.connect_s, t.decode_event_s, t.write_s)

    def attempts(self, role: Role, ctx: RequestContext) -> Attempts:
        max_attempts = (
            self.cfg.max_prefill_attempts if role == "prefill" else self.cfg.max_decode_attempts
        )
        return Attempts(role, ctx, self.selector, self.registry, self.metrics, max_attempts,
                        self.cfg.retry_backoff_s)  # fmt: skip
