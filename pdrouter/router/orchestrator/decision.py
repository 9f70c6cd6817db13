"""Conditional disaggregation as the router sees it: which path a request took, and why.

    pd     P prefilled and handed the KV over through the pool; reason `disabled` (the
           threshold is 0) or `uncached_at_or_above_threshold`
    local  P left the prompt to D (LocalPrefill); reason `uncached_below_threshold`

The router does not tokenize: P, the tokenizer of record, counts the uncached tokens
(workers/prefill/local_decision.py) against the threshold the request carried. Each decision
is counted (pdrouter_disaggregation_decisions_total{path, reason}) and marked in the request's
timeline (event `disaggregation`, with the counts when P gave them).
"""

from __future__ import annotations

from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.wire.pd import LocalPrefill, PrefillResult

LOCAL_REASON = "uncached_below_threshold"


def pd_reason(threshold_tokens: int) -> str:
    return "disabled" if threshold_tokens <= 0 else "uncached_at_or_above_threshold"


def record_decision(
    metrics: RouterMetrics,
    ctx: RequestContext,
    answer: PrefillResult | LocalPrefill,
    threshold_tokens: int,
) -> None:
    """Count P's answer's path and mark it, with its reason, in the request's timeline."""
    if isinstance(answer, LocalPrefill):
        metrics.disaggregation_decisions.labels("local", LOCAL_REASON).inc()
        ctx.mark(
            "disaggregation",
            path="local",
            reason=LOCAL_REASON,
            uncached_tokens=answer.num_uncached_tokens,
            threshold_tokens=answer.threshold_tokens,
        )
        return
    reason = pd_reason(threshold_tokens)
    metrics.disaggregation_decisions.labels("pd", reason).inc()
    if ctx.timeline is not None:  # the counts travel in the prefill part of the timeline
        ctx.timeline.mark(
            "disaggregation", path="pd", reason=reason, threshold_tokens=threshold_tokens
        )
