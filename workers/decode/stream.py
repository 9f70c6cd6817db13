"""The stream stage of a decode request: the tokens of the request the engine has taken go
back as SSE DecodeEvents; after the last event, the request's blocks the pool lacks
are written back in the background (workers/handoff/writeback.py), so the next chat turn
hits them on any P.

The engine has the request (and its blocks) before the stream starts (stages.hand_over), and
its first output has come (stages.first_output). Closing the stream, also one never read,
aborts the request, and the engine frees its blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import DecodeEvent, DecodeTimings, decode_event_sse
from pdrouter.wire.responses import sse_error
from workers.decode.local_prefill import cached_split
from workers.engine.api import EngineRequest, RequestOutput
from workers.engine.request_stream import RequestStream
from workers.handoff.pool_prefix import PoolPrefix
from workers.handoff.reader import ReadOutcome
from workers.handoff.writeback import WriteBack, WriteBackTarget
from workers.server.logprobs import wire_logprobs
from workers.server.metrics import RequestStatus
from workers.server.pd_worker import PDSeam

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamTiming:
    """When the request started, how long it waited for blocks, when its first output came
    (all monotonic seconds)."""

    start_s: float
    alloc_wait_s: float
    first_s: float


def writeback_target(seam: PDSeam) -> WriteBackTarget:
    """Where a finished request's blocks are written back from and to."""
    return WriteBackTarget(
        engine=seam.engine,
        pool=seam.pool,
        fingerprint=seam.identity.fingerprint,
        block_size=seam.identity.block_size,
        group_blocks=seam.settings.transfer_batch_blocks,
        wait_s=seam.settings.wait_s,
    )


class DecodeStream:
    """The SSE body of one decode request the engine has taken (its blocks are the engine's):
    the first output, awaited before the response started, then the rest as they come.

    An async iterator, not a generator, so that aclose() aborts the request even when the
    body was never read (a client gone between admit and the first read): a generator that
    never started has no `finally` to run."""

    def __init__(
        self,
        seam: PDSeam,
        engine_req: EngineRequest,
        outputs: RequestStream,
        first: RequestOutput,
        loaded: ReadOutcome,
        timing: StreamTiming,
        writeback: WriteBack | None,
        prefix: PoolPrefix | None = None,
        num_loaded_ahead: int | None = None,
        sequence_numbers: tuple[int, ...] = (),
    ) -> None:
        self.seam = seam
        # A group's: the request's number of each engine sequence (DecodeEvent.index).
        self.sequence_numbers = sequence_numbers
        self.num_loaded_ahead = num_loaded_ahead  # of loaded, read before the decode came
        self.req = engine_req
        self.outputs = outputs
        self.first = first
        self.loaded = loaded
        self.timing = timing
        self.writeback = writeback
        self.prefix = prefix  # a request D prefilled itself: the prompt's cached prefix
        self._events = self._generate()
        self._observed = False
        # Each sequence's output tokens so far (by engine sequence index), from those it came
        # with: D's generated tokens are their growth, every sequence's.
        given = (engine_req.output_token_ids, *engine_req.sequence_output_token_ids)
        self._num_out = {j: len(ids) for j, ids in enumerate(given)}
        self._num_given = sum(self._num_out.values())
        self._num_out[first.sequence_index] = first.num_output_tokens

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        """Close the body; aborts the request unless its final output came."""
        try:
            await self._events.aclose()
        finally:
            await self.outputs.aclose()
            self._observe("aborted", None)

    async def _generate(self) -> AsyncGenerator[bytes, None]:
        status: RequestStatus = "aborted"
        new_ids: list[int] = []
        ttft_s = None
        try:
            async with contextlib.aclosing(self.outputs):
                out = self.first
                while True:
                    self._num_out[out.sequence_index] = out.num_output_tokens
                    new_ids.extend(out.new_token_ids)
                    if ttft_s is None and out.new_token_ids:
                        now_s = self.timing.first_s if out is self.first else time.monotonic()
                        ttft_s = now_s - self.timing.start_s
                    yield decode_event_sse(self._event(out, ttft_s))
                    if out.ends_stream:  # a group's: its last sequence's final event
                        break
                    out = await anext(self.outputs)
            status = "success"
            if self.writeback is not None:  # after the last event: off the token path
                req = self.req
                tokens = (*req.prompt_token_ids, *req.output_token_ids, *new_ids)
                if self.sequence_numbers:  # a group's tokens interleave: its prompt only
                    tokens = req.prompt_token_ids
                target = writeback_target(self.seam)
                self.writeback.submit(target, req.request_id, tokens, req.cache_scope)
        except APIError as exc:
            status = "error"
            yield sse_error(exc.message)
        except Exception:
            log.exception("decode of %s failed mid-stream", self.req.request_id)
            status = "error"
            yield sse_error("the decode engine failed while generating; see the worker log")
        finally:
            self._observe(status, ttft_s)

    def _observe(self, status: RequestStatus, ttft_s: float | None) -> None:
        """Count the request once: how its stream ended (aborted if never read), and the
        tokens it generated here: every sequence's, less those it came with."""
        if self._observed:
            return
        self._observed = True
        self.seam.server_metrics.observe_request(
            "decode",
            status,
            num_generated_tokens=sum(self._num_out.values()) - self._num_given,
            ttft_s=ttft_s,
        )

    def _event(self, out: RequestOutput, ttft_s: float | None) -> DecodeEvent:
        with_logprobs = self.req.params.num_logprobs is not None
        event = DecodeEvent(
            token_ids=list(out.new_token_ids),
            text=out.new_text,
            finished=out.finished,
            finish_reason=out.finish_reason if out.finished else None,  # type: ignore[arg-type]
            num_output_tokens=out.num_output_tokens,
            logprobs=(
                wire_logprobs(self.seam.engine.tokenizer, out.new_logprobs)
                if with_logprobs
                else None
            ),
        )
        if self.sequence_numbers:
            index = self.sequence_numbers[out.sequence_index]
            event = event.model_copy(update={"index": index, "more": out.more_sequences})
        if out.finished:
            event = event.model_copy(update=self._final_fields(ttft_s))
        return event

    def _final_fields(self, ttft_s: float | None) -> dict[str, Any]:
        num_prompt = len(self.req.prompt_token_ids)
        fields = {
            "num_blocks_loaded": self.loaded.num_loaded,
            "num_tokens_recomputed": num_prompt - self.req.num_computed_tokens,
            "num_bytes_read": self.loaded.num_bytes,
            "num_blocks_loaded_ahead": self.num_loaded_ahead,
            "timings": DecodeTimings(
                alloc_wait_s=self.timing.alloc_wait_s,
                get_s=self.loaded.timings.get_s,
                h2d_s=self.loaded.timings.h2d_s,
                ttft_s=ttft_s or 0.0,
            ),
        }
        if self.prefix is not None:  # D prefilled: the client's cached_tokens come from D
            num_cached, num_pool = cached_split(num_prompt, self.first, self.prefix)
            fields["num_cached_tokens"] = num_cached
            fields["num_pool_cached_tokens"] = num_pool
            fields["num_host_cached_tokens"] = min(
                self.first.num_host_cached_tokens, num_cached - num_pool
            )
            fields["num_tokens_recomputed"] = 0  # computed by choice, not for missing blocks
        return fields
