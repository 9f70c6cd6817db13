"""The decode stage: D's events after the first token, relayed batch by batch.

    router ─► D  POST /internal/decode {request_id, body, prompt_token_ids, output_token_ids, kv}
             ◄── DecodeEvent stream (SSE) | an error answer | a transport failure (failures.py)

A D that fails before its first event is replaced by another (a retry); one that fails after
some events is replaced by another D that resumes after every token the client already has
(a failover): the KV blocks are still in the pool, and output_token_ids carries the tokens.

After P's LocalPrefill, D gets no KV handle and no first token: it prefills the prompt itself
and its first event carries the first token; a retry recomputes the prompt on another D the
same way, a failover the prompt and the tokens sent so far.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pdrouter.router.orchestrator.attempts import Attempts, Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.failures import answer_outcome, contract_broken
from pdrouter.router.upstream.decode_stream import BadEvent, event_batches
from pdrouter.router.upstream.token_events import OutputIds, TokenEvent
from pdrouter.wire.pd import (
    DecodeEvent,
    LocalPrefill,
    MissingKVPolicy,
    PrefillResult,
    decode_request_json,
)

# The events one read of D's stream brought in: token events matched, the others validated.
DecodeBatch = list[DecodeEvent | TokenEvent]


async def decode_events(
    hop: Hop,
    ctx: RequestContext,
    result: PrefillResult | LocalPrefill,
    missing_kv_policy: MissingKVPolicy | None,
) -> AsyncIterator[DecodeBatch]:
    """D's events after P's first token (after LocalPrefill: from the first), in batches
    (those one read brought in)."""
    kv = result.kv if isinstance(result, PrefillResult) else None
    # D's token events keep their ids as digits until a resume asks for them (OutputIds).
    output_ids = OutputIds([result.first_token_id] if isinstance(result, PrefillResult) else [])

    def payload() -> bytes:
        return decode_request_json(
            ctx.request_id,
            ctx.endpoint,
            ctx.body,
            result.prompt_token_ids,
            output_ids.ids(),
            kv,
            missing_kv_policy,
            ctx.cache_scope,
        )

    num_tokens = len(result.prompt_token_ids) + ctx.max_output_tokens
    async for batch in attempted_events(hop, ctx, result, payload, output_ids.add, num_tokens):
        yield batch


async def attempted_events(
    hop: Hop,
    ctx: RequestContext,
    result: PrefillResult | LocalPrefill,
    payload: Callable[[], bytes],
    advance: Callable[[DecodeEvent], None],
    num_tokens: int,
) -> AsyncIterator[list[DecodeEvent]]:
    """The decode stage's attempts: payload() (made again for each attempt: a failover
    resumes from what advance() saw of every event) to one D after another, its events
    yielded in batches until the one that ends the stream; num_tokens the load held on D."""
    kv = result.kv if isinstance(result, PrefillResult) else None
    attempts = Attempts(hop, ctx)
    resumes = False  # the attempt that failed had sent events: the next one is a failover
    while (inst := await attempts.next()) is not None:
        if resumes:
            hop.metrics.failovers.labels("decode").inc()
        ctx.decode_urls.append(inst.url)
        body = payload()
        ctx.mark("decode_sent", url=inst.url, attempt=attempts.number)
        num_events = 0  # events of this attempt: a failure after one is a failover
        with attempts.start(inst, num_tokens) as attempt:
            async with attempt.send(body) as resp:
                if resp.status_code != 200:
                    await attempt.guard.call(resp.read())
                    attempt.fail(answer_outcome("decode", inst.url, resp))
                else:
                    if ctx.prefetch is not None and kv is not None:  # else D released it
                        ctx.prefetch.decoded_on(inst.url)
                    try:
                        # After the final batch the loop goes on only while event_batches
                        # reads D's body to its end, once the client has been served.
                        batches = event_batches(
                            resp.chunks(), inst.url, attempt.guard, lambda: resp.body_complete
                        )
                        async for batch in batches:
                            for ev in batch:
                                advance(ev)
                            num_events += len(batch)
                            last = batch[-1]  # a batch ends at the final event, if it holds it
                            if last.ends_stream:
                                assert isinstance(last, DecodeEvent)  # validated, never matched
                                attempt.succeed()
                                hop.metrics.account_decode(last, kv, len(result.prompt_token_ids))
                                if ctx.timeline is not None:
                                    ctx.timeline.record_decode(inst.url, last)
                            yield batch
                    except BadEvent as exc:
                        attempt.fail(contract_broken(exc.message))
                    if not attempt.ok and attempt.failure is None:
                        attempt.fail(
                            contract_broken("the stream ended before the request finished")
                        )
        if attempt.failure is None:
            return
        resumes = num_events > 0  # the client has part of the answer: the next D resumes it
        await attempts.failed(inst, attempt.failure, "failover" if resumes else "retry")
    raise attempts.error()
