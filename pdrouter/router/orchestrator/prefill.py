"""The prefill stage: P's result (first token, KV handle), tried on another P on failure.

    router ─► P  POST /internal/prefill {request_id, endpoint, body}
             ◄── PrefillResult | an error answer | a transport failure (failures.py)

Every attempt gives its P's breaker exactly one verdict: a malformed 200 is one failure, never
a success as well.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from pdrouter.router.instances.call_guard import CallGuard
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.failures import (
    Failure,
    answer_outcome,
    contract_broken,
    transport_failure,
)
from pdrouter.router.orchestrator.hops import Hops
from pdrouter.router.selection.admission import Hold
from pdrouter.router.selection.breaker import is_failure_status
from pdrouter.wire.pd import PREFILL_PATH, REQUEST_ID_HEADER, PrefillResult, prefill_request_json


async def prefill(hops: Hops, ctx: RequestContext) -> PrefillResult:
    """P's result, retried on other P instances after a failure before the result."""
    payload = prefill_request_json(ctx.request_id, ctx.endpoint, ctx.body)
    # The answer's frame is made while P works (this runs when the task first waits),
    # rather than between P's answer and the first token's write.
    asyncio.get_running_loop().call_soon(ctx.frame)
    headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
    attempts = hops.attempts("prefill", ctx)
    while (inst := await attempts.next()) is not None:
        ctx.mark("prefill_sent", url=inst.url, attempt=attempts.number)
        verdict: bool | None = None  # stays None if the caller cancels this call
        failure: Failure | None = None
        try:
            with (
                Hold(inst, ctx.prompt_tokens_estimate),
                CallGuard(inst.calls, inst.url, ctx.task) as guard,
            ):
                call = hops.upstream.request(
                    "POST", inst.url + PREFILL_PATH, payload, headers, hops.prefill_timeout
                )
                async with guard.entered(call) as resp:
                    await guard.call(resp.read())
            if resp.status_code == 200:
                try:
                    result = PrefillResult.model_validate_json(resp.content)
                except ValueError as exc:  # a worker of another version, or a broken proxy
                    failure = contract_broken(f"malformed prefill result: {exc}")
            else:
                verdict = is_failure_status(resp.status_code)  # stands if the answer is final
                failure = answer_outcome("prefill", inst.url, resp)  # raises a final answer
            verdict = failure.breaker if failure is not None else False
        except httpx.HTTPError as exc:
            failure = transport_failure(exc)
            verdict = failure.breaker
        finally:
            hops.selector.verdict(inst, verdict)
        if failure is not None:
            await attempts.failed(inst, failure)
            continue
        hops.metrics.account_prefill(result)
        hops.metrics.prefill_s.observe(time.monotonic() - ctx.arrival_s)
        ctx.prefill_url = inst.url
        if ctx.timeline is not None:
            ctx.timeline.record_prefill(inst.url, result)
        return result
    raise attempts.error()
