"""The prefill stage: P's result (first token, KV handle), tried on another P on failure.

    router ─► P  POST /internal/prefill {request_id, endpoint, body, cache_scope,
                                         local_prefill_below_tokens}
             ◄── PrefillResult | LocalPrefill | an error answer | a transport failure

LocalPrefill is P's decision that D prefills the prompt itself (conditional disaggregation:
fewer of its tokens than the threshold are missing from P's caches); the decision and why go
into the timeline and pdrouter_disaggregation_decisions_total (decision.py).

Every attempt gives its P's breaker exactly one verdict (attempts.Attempt): a malformed 200 is
one failure, never a success as well.
"""

from __future__ import annotations

import asyncio
import time

from pdrouter.router.orchestrator.attempts import Attempts, Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.decision import record_decision
from pdrouter.router.orchestrator.failures import answer_outcome, contract_broken
from pdrouter.wire.pd import PREFILL_ANSWER, LocalPrefill, PrefillResult, prefill_request_json


async def prefill(
    hop: Hop, ctx: RequestContext, local_prefill_below_tokens: int = 0
) -> PrefillResult | LocalPrefill:
    """P's result (or its decision that D prefills: LocalPrefill), retried on other P
    instances after a failure before the result."""
    payload = prefill_request_json(
        ctx.request_id, ctx.endpoint, ctx.body, ctx.cache_scope, local_prefill_below_tokens
    )
    # The answer's frame is made while P works (this runs when the task first waits),
    # rather than between P's answer and the first token's write.
    asyncio.get_running_loop().call_soon(ctx.frame)
    attempts = Attempts(hop, ctx)
    while (inst := await attempts.next()) is not None:
        ctx.mark("prefill_sent", url=inst.url, attempt=attempts.number)
        with attempts.start(inst, ctx.prompt_tokens_estimate) as attempt:
            async with attempt.send(payload) as resp:
                await attempt.guard.call(resp.read())
            if resp.status_code != 200:
                attempt.fail(answer_outcome("prefill", inst.url, resp))
            else:
                try:
                    result = PREFILL_ANSWER.validate_json(resp.content)
                except ValueError as exc:  # a worker of another version, or a broken proxy
                    attempt.fail(contract_broken(f"malformed prefill result: {exc}"))
                else:
                    attempt.succeed()
        if attempt.failure is not None:
            await attempts.failed(inst, attempt.failure)
            continue
        now_s = time.monotonic()
        hop.metrics.prefill_s.observe(now_s - ctx.arrival_s)
        ctx.prefill_url = inst.url
        if isinstance(result, PrefillResult):
            ctx.prefill_done_s = now_s
            hop.metrics.account_prefill(result)
            if ctx.timeline is not None:
                ctx.timeline.record_prefill(inst.url, result)
        else:
            ctx.mark("prefill_done", url=inst.url)
        record_decision(hop.metrics, ctx, result, local_prefill_below_tokens)
        return result
    raise attempts.error()
