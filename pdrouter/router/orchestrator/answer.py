"""The client's answer: P's first token at once, then D's events relayed (stream or whole).

    stream:   P's first token ─► one SSE write; each batch of D's events ─► one write; the
              final event's chunk, usage (if asked) and [DONE] leave in one last write
    complete: the same events assembled into one OpenAI response

Usage = P's prompt count (and its cached tokens) + D's output count. What the answer held
(tokens, first token and last write times) is left on the RequestContext (answered()) for the
request's end (pdrouter.router.service), which records it once the last byte is out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator.attempts import Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.decode import decode_events
from pdrouter.wire.logprobs import TokenLogprob, text_length
from pdrouter.wire.pd import DecodeEvent, MissingKVPolicy, PrefillResult
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
        self, ctx: RequestContext, result: PrefillResult
    ) -> AsyncIterator[list[DecodeEvent]]:
        return decode_events(self.decode, ctx, result, self.missing_kv_policy)

    def _relayed(self, ctx: RequestContext, batch: list[DecodeEvent], last_s: float) -> float:
        """Per relayed batch (the events of one read): each event's inter-token latency (the
        batch's arrival gap for its first event, 0 for the ones that came with it) and the
        first decode token's timeline mark; returns the time to measure the next gap from."""
        now = time.monotonic()
        first: DecodeEvent | None = None  # the batch's first event with tokens
        num_with_tokens = 0
        for ev in batch:
            if ev.token_ids:
                num_with_tokens += 1
                if first is None:
                    first = ev
        if first is None:
            return now
        self.metrics.itl_s.observe((now - last_s) / len(first.token_ids))
        if num_with_tokens > 1:  # the events that came with it: no gap
            self.metrics.itl_s.observe_many(0.0, num_with_tokens - 1)
        timeline = ctx.timeline
        if timeline is not None and not timeline.has("first_decode_token"):
            ctx.mark("first_decode_token")
        return now

    async def stream(self, ctx: RequestContext, result: PrefillResult) -> AsyncIterator[bytes]:
        """SSE bytes for a streaming client: P's first token at once, then D's relayed; the
        last part ends with [DONE]. An error raises: the caller writes it in-band."""
        frame = ctx.frame()
        n_prompt = len(result.prompt_token_ids)
        n_cached = result.num_cached_tokens  # P's cache hits; D's load of P's handoff is not one
        n_out = 1
        first_lp = result.first_logprobs
        yield frame.chunk(result.first_text, result.finish_reason, first=True, logprobs=first_lp)
        offset = text_length(first_lp or ())  # completions' text_offset of the next token
        t_first = last_s = time.monotonic()
        self.metrics.ttft_s.observe(t_first - ctx.arrival_s)
        ctx.mark("first_token_sent")
        if result.finish_reason is not None:
            ctx.answered(n_prompt, n_out, t_first, time.monotonic())
            yield self._last_write(frame, [], ctx.include_usage, n_prompt, n_out, n_cached)
            return
        # aclosing: a client that leaves closes D's stream now, not at garbage collection.
        async with contextlib.aclosing(self._events(ctx, result)) as batches:
            async for batch in batches:
                # One write for the whole batch: each token stays its own SSE event.
                parts = []
                for ev in batch:
                    n_out = ev.num_output_tokens
                    lp = ev.logprobs
                    if ev.finished or ev.text or lp:
                        chunk = frame.chunk(ev.text, ev.finish_reason, logprobs=lp,
                                            text_offset=offset)  # fmt: skip
                        parts.append(chunk)
                        if lp:  # most streams ask for no logprobs
                            offset += text_length(lp)
                last_s = self._relayed(ctx, batch, last_s)
                if batch[-1].finished:
                    # The final event's chunk and [DONE] leave in one write now; asked for
                    # more after it, the loop only lets event_batches read D's body to its end.
                    ctx.answered(n_prompt, n_out, t_first, time.monotonic())
                    yield self._last_write(frame, parts, ctx.include_usage,
                                           n_prompt, n_out, n_cached)  # fmt: skip
                elif parts:
                    yield b"".join(parts)

    @staticmethod
    def _last_write(frame: ResponseFrame, parts: list[bytes], include_usage: bool,
                    n_prompt: int, n_out: int, n_cached: int) -> bytes:  # fmt: skip
        """The stream's last write: the final chunk, usage if asked for, [DONE]."""
        if include_usage:
            parts.append(frame.usage_chunk(n_prompt, n_out, n_cached))
        return b"".join(parts) + SSE_DONE

    async def complete(self, ctx: RequestContext, result: PrefillResult) -> dict[str, Any]:
        """The whole non-streamed response."""
        texts = [result.first_text]
        first_lp = result.first_logprobs
        logprobs: list[TokenLogprob] | None = None if first_lp is None else list(first_lp)
        finish_reason = result.finish_reason
        n_out = 1
        t_first = last_s = time.monotonic()
        self.metrics.ttft_s.observe(t_first - ctx.arrival_s)
        if finish_reason is None:
            async with contextlib.aclosing(self._events(ctx, result)) as batches:
                async for batch in batches:
                    for ev in batch:
                        texts.append(ev.text)
                        n_out = ev.num_output_tokens
                        if logprobs is not None:
                            logprobs.extend(ev.logprobs or ())
                        if ev.finished:
                            finish_reason = ev.finish_reason
                    last_s = self._relayed(ctx, batch, last_s)
        n_prompt = len(result.prompt_token_ids)
        ctx.answered(n_prompt, n_out, t_first, time.monotonic())
        return ctx.frame().response(
            "".join(texts),
            finish_reason or "stop",
            n_prompt,
            n_out,
            logprobs,
            num_cached_tokens=result.num_cached_tokens,
        )
