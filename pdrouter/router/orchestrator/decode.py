"""The decode stage: D's events after the first token, relayed batch by batch.

    router ─► D  POST /internal/decode {request_id, body, prompt_token_ids, output_token_ids, kv}
             ◄── DecodeEvent stream (SSE) | an error answer | a transport failure (failures.py)

A D that fails before its first event is replaced by another (a retry); one that fails after
some events is replaced by another D that resumes after every token the client already has
(a failover): the KV blocks are still in the pool, and output_token_ids carries the tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from pdrouter.router.instances.call_guard import CallGuard
from pdrouter.router.instances.instance import Instance
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
from pdrouter.router.upstream.decode_stream import BadEvent, event_batches
from pdrouter.wire.pd import (
    DECODE_PATH,
    REQUEST_ID_HEADER,
    DecodeEvent,
    PrefillResult,
    decode_request_json,
)


async def decode_events(
    hops: Hops, ctx: RequestContext, result: PrefillResult
) -> AsyncIterator[list[DecodeEvent]]:
    """D's events after the first token, in batches (those one read brought in)."""
    output_ids = [result.first_token_id]
    headers = {REQUEST_ID_HEADER: ctx.request_id, "Content-Type": "application/json"}
    num_tokens = len(result.prompt_token_ids) + ctx.max_output_tokens
    attempts = hops.attempts("decode", ctx)
    resumes = False  # the attempt that failed had sent events: the next one is a failover
    while (inst := await attempts.next()) is not None:
        if resumes:
            hops.metrics.failovers.labels("decode").inc()
        ctx.decode_urls.append(inst.url)
        payload = decode_request_json(ctx.request_id, ctx.endpoint, ctx.body,
                                      result.prompt_token_ids, output_ids, result.kv,
                                      hops.cfg.missing_kv_policy)  # fmt: skip
        ctx.mark("decode_sent", url=inst.url, attempt=attempts.number)
        verdict: bool | None = None  # stays None if the client leaves mid-call
        failure: Failure | None = None
        num_events = 0  # events of this attempt: a failure after one is a failover
        try:
            with Hold(inst, num_tokens), CallGuard(inst.calls, inst.url, ctx.task) as guard:
                call = hops.upstream.request(
                    "POST", inst.url + DECODE_PATH, payload, headers, hops.decode_timeout
                )
                async with guard.entered(call) as resp:
                    if resp.status_code != 200:
                        await guard.call(resp.read())
                        verdict = is_failure_status(resp.status_code)  # stands if final
                        failure = answer_outcome("decode", inst.url, resp)  # raises if final
                    else:
                        try:
                            # After the final batch the loop goes on only while event_batches
                            # reads D's body to its end, once the client has been served.
                            async for batch in event_batches(resp.chunks(), inst.url, guard):
                                for ev in batch:
                                    output_ids.extend(ev.token_ids)
                                    num_events += 1
                                    if ev.finished:
                                        verdict = False
                                        _record_decode(hops, ctx, inst, ev, result)
                                yield batch
                        except BadEvent as exc:
                            failure = contract_broken(exc.message)
                        if verdict is False:  # the final event came
                            return
                        failure = failure or contract_broken(
                            "the stream ended before the request finished"
                        )
            verdict = failure.breaker
        except httpx.HTTPError as exc:
            failure = transport_failure(exc)
            verdict = failure.breaker
        finally:
            hops.selector.verdict(inst, verdict)
        resumes = num_events > 0  # the client has part of the answer: the next D resumes it
        await attempts.failed(inst, failure, "failover" if resumes else "retry")
    raise attempts.error()


def _record_decode(
    hops: Hops, ctx: RequestContext, inst: Instance, ev: DecodeEvent, result: PrefillResult
) -> None:
    """D's final event: pool and handoff metrics, and D's timings on the timeline."""
    hops.metrics.account_decode(ev, result.kv)
    if ctx.timeline is not None:
        ctx.timeline.record_decode(inst.url, ev)
