"""The client's answer: P's first token at once, then D's events relayed (stream or whole).

    stream:   P's first token ─► one SSE write; each batch of D's events ─► one write; the
              final event's chunk, usage (if asked) and [DONE] leave in one last write
    complete: the same events assembled into one OpenAI response

Usage = P's prompt count (and its cached tokens) + D's output count, also counted as it is
relayed (ctx.meter: a request that ends early is charged what it got). What the answer held
(tokens, first token and last write times) is left on the RequestContext (answered()) for the
request's end (pdrouter.router.service), which records it once the last byte is out.

After P's LocalPrefill (D prefills the prompt itself) there is no first token from P: D's
first event is the first token (the first chunk, TTFT, first_token_sent) and D's final event
gives the cached tokens. Two gaps are measured on the way and marked in the timeline: the
handoff left after P's first token (P's result arriving to D's first event; through P and the
pool only: pdrouter_handoff_after_first_token_seconds) and, on a stream, the first token's
write to the second's (pdrouter_first_to_second_token_seconds).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.attempts import Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.decode import DecodeBatch, decode_events
from pdrouter.router.upstream.token_events import TokenEvent
from pdrouter.wire.logprobs import TokenLogprob, text_length
from pdrouter.wire.pd import DecodeEvent, LocalPrefill, MissingKVPolicy, PrefillResult
from pdrouter.wire.responses import SSE_DONE, ResponseFrame


class Answers:
    """Builds the client's answer from P's result and D's events (the decode hop's)."""

    def __init__(
        self, metrics: RouterMetrics, decode: Hop, missing_kv_policy: MissingKVPolicy | None
    ) -> None:
        self.metrics = metrics
        self.decode = decode
        self.missing_kv_policy = missing_kv_policy

    def _events(
        self, ctx: RequestContext, result: PrefillResult | LocalPrefill
    ) -> AsyncIterator[DecodeBatch]:
        return decode_events(self.decode, ctx, result, self.missing_kv_policy)

    def _first_token(self, ctx: RequestContext, sent: bool) -> float:
        """The first token is out (sent: a stream's write) or known: TTFT; returns now."""
        now = time.monotonic()
        self.metrics.ttft_s.observe(now - ctx.arrival_s)
        if sent:
            ctx.mark("first_token_sent")
        return now

    def _relayed(self, ctx: RequestContext, batch: DecodeBatch, last_s: float) -> float:
        """Per relayed batch (the events of one read): each event's inter-token latency (the
        batch's arrival gap for its first event, 0 for the ones that came with it; last_s 0:
        the batch holds the request's first token, whose time is TTFT, not a gap), D's first
        event's mark and the handoff left after P's first token; returns the time to measure
        the next gap from."""
        now = time.monotonic()
        first: DecodeEvent | TokenEvent | None = None  # the batch's first event with tokens
        num_with_tokens = 0
        for ev in batch:
            if type(ev) is TokenEvent or ev.token_ids:  # a token event always holds one
                num_with_tokens += 1
                if first is None:
                    first = ev
        if first is None:
            return now
        if last_s:
            self.metrics.itl_s.observe((now - last_s) / first.num_token_ids)
        if num_with_tokens > 1:  # the events that came with it: no gap
            self.metrics.itl_s.observe_many(0.0, num_with_tokens - 1)
        if not ctx.decode_first_s:
            self._decode_started(ctx, now)
        return now

    def _decode_started(self, ctx: RequestContext, now: float) -> None:
        """D's first event came (now): its mark, and the handoff left after P's first token."""
        ctx.decode_first_s = now
        if ctx.prefill_done_s:  # through P and the pool: the handoff P's answer left
            handoff_s = now - ctx.prefill_done_s
            self.metrics.handoff_after_first_token_s.observe(handoff_s)
            ctx.mark("first_decode_token", handoff_after_first_token_ms=_ms(handoff_s))
        else:
            ctx.mark("first_decode_token")

    def _second_token(
        self, ctx: RequestContext, num_before: int, t_first: float, now: float
    ) -> None:
        """A stream's second token left in this write: the first-to-second token gap (0 when
        both left in one write, as D's first two tokens may after a LocalPrefill)."""
        gap_s = now - t_first if num_before == 1 else 0.0
        self.metrics.first_to_second_token_s.observe(gap_s)
        ctx.mark("second_token_sent", first_to_second_token_ms=_ms(gap_s))

    async def stream(
        self, ctx: RequestContext, result: PrefillResult | LocalPrefill
    ) -> AsyncIterator[bytes]:
        """SSE bytes for a streaming client: P's first token at once (after LocalPrefill: D's
        first), then D's relayed; the last part ends with [DONE]. An error raises: the caller
        writes it in-band."""
        frame = ctx.frame()
        n_prompt = len(result.prompt_token_ids)
        ctx.meter.prompt(ctx.prompt_index, n_prompt)  # counted as relayed: Tenancy.end
        n_out = n_cached = offset = 0  # offset: completions' text_offset of the next token
        t_first = last_s = 0.0
        first_from_d = isinstance(result, LocalPrefill)  # D's first event is the first chunk
        if isinstance(result, PrefillResult):
            n_cached = result.num_cached_tokens  # P's hits; D's load of P's handoff is not one
            first_lp = result.first_logprobs
            ctx.meter.output(1)
            yield frame.chunk(
                result.first_text, result.finish_reason, first=True, logprobs=first_lp
            )
            offset, n_out = text_length(first_lp or ()), 1
            t_first = last_s = self._first_token(ctx, sent=True)
            if result.finish_reason is not None:
                ctx.answered(n_prompt, n_out, t_first, time.monotonic())
                yield self._last_write(frame, [], ctx.include_usage, n_prompt, n_out, n_cached)
                return
        splice = frame.text_chunk_parts  # a text delta's chunk around its JSON string
        # aclosing: a client that leaves closes D's stream now, not at garbage collection.
        async with contextlib.aclosing(self._events(ctx, result)) as batches:
            async for batch in batches:
                # One write for the whole batch: each token stays its own SSE event.
                parts = []
                num_before = n_out
                for ev in batch:
                    if type(ev) is TokenEvent and splice is not None and not first_from_d:
                        text_json = ev[1]  # text_json: D's, as chunk() would encode the text
                        if len(text_json) > 2:  # not ""
                            parts.append(splice[0] + text_json + splice[1])
                        continue
                    lp = ev.logprobs
                    if first_from_d and (ev.token_ids or ev.finished):
                        first_from_d = False
                        parts.append(
                            frame.chunk(ev.text, ev.finish_reason, first=True, logprobs=lp)
                        )
                        offset += text_length(lp or ())
                    elif ev.finished or ev.text or lp:
                        chunk = frame.chunk(
                            ev.text, ev.finish_reason, logprobs=lp, text_offset=offset
                        )
                        parts.append(chunk)
                        if lp:  # most streams ask for no logprobs
                            offset += text_length(lp)
                    if ev.num_cached_tokens is not None:  # D prefilled: its cache hits
                        n_cached = ev.num_cached_tokens
                n_out = batch[-1].num_output_tokens  # each event's count is the total so far
                ctx.meter.output(n_out - num_before)
                last_s = self._relayed(ctx, batch, last_s)
                if not t_first and n_out:
                    t_first = self._first_token(ctx, sent=True)
                if num_before < 2 <= n_out:
                    self._second_token(ctx, num_before, t_first, last_s)
                if batch[-1].finished:
                    # The final event's chunk and [DONE] leave in one write now; asked for
                    # more after it, the loop only lets event_batches read D's body to its end.
                    ctx.answered(n_prompt, n_out, t_first, time.monotonic())
                    yield self._last_write(
                        frame, parts, ctx.include_usage, n_prompt, n_out, n_cached
                    )
                elif parts:
                    yield b"".join(parts)

    @staticmethod
    def _last_write(
        frame: ResponseFrame,
        parts: list[bytes],
        include_usage: bool,
        n_prompt: int,
        n_out: int,
        n_cached: int,
    ) -> bytes:
        """The stream's last write: the final chunk, usage if asked for, [DONE]."""
        if include_usage:
            parts.append(frame.usage_chunk(n_prompt, n_out, n_cached))
        return b"".join(parts) + SSE_DONE

    async def complete(
        self, ctx: RequestContext, result: PrefillResult | LocalPrefill
    ) -> dict[str, Any]:
        """The whole non-streamed response."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] | None = None
        finish_reason = None
        n_out = n_cached = 0
        t_first = last_s = 0.0
        ctx.meter.prompt(ctx.prompt_index, len(result.prompt_token_ids))
        if isinstance(result, PrefillResult):
            ctx.meter.output(1)
            texts.append(result.first_text)
            first_lp = result.first_logprobs
            logprobs = None if first_lp is None else list(first_lp)
            finish_reason, n_out, n_cached = result.finish_reason, 1, result.num_cached_tokens
            t_first = last_s = self._first_token(ctx, sent=False)
        if finish_reason is None:
            async with contextlib.aclosing(self._events(ctx, result)) as batches:
                async for batch in batches:
                    for ev in batch:
                        texts.append(ev.text)
                        if ev.logprobs is not None:
                            if logprobs is None:  # D's first token (LocalPrefill)
                                logprobs = []
                            logprobs.extend(ev.logprobs)
                        if ev.finished:
                            finish_reason = ev.finish_reason
                        if ev.num_cached_tokens is not None:  # D prefilled: its cache hits
                            n_cached = ev.num_cached_tokens
                    ctx.meter.output(batch[-1].num_output_tokens - n_out)
                    n_out = batch[-1].num_output_tokens  # each event's count: the total so far
                    last_s = self._relayed(ctx, batch, last_s)
                    if not t_first and n_out:
                        t_first = self._first_token(ctx, sent=False)
        n_prompt = len(result.prompt_token_ids)
        ctx.answered(n_prompt, n_out, t_first, time.monotonic())
        return ctx.frame().response(
            "".join(texts),
            finish_reason or "stop",
            n_prompt,
            n_out,
            logprobs,
            num_cached_tokens=n_cached,
        )


def _ms(seconds: float) -> float:
    return round(1000.0 * seconds, 3)
