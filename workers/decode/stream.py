"""The stream stage of a decode request: its EngineRequest joins the running batch and its
tokens go back as SSE DecodeEvents; after the last event, the request's blocks the pool lacks
are written back in the background (workers/handoff/writeback.py), so the next chat turn
hits them on any P.

Closing the stream aborts the request; a stream closed before it ever reached the engine
frees its blocks (on_close).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import DecodeEvent, DecodeTimings, decode_event_sse
from pdrouter.wire.responses import sse_error
from workers.engine.api import EngineRequest, RequestOutput
from workers.handoff.reader import ReadOutcome
from workers.handoff.writeback import WriteBack, WriteBackTarget
from workers.server.logprobs import wire_logprobs
from workers.server.pd_worker import PDSeam

log = logging.getLogger(__name__)


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
    """The SSE body of one decode request; frees its blocks if it never reached the engine."""

    def __init__(
        self,
        seam: PDSeam,
        engine_req: EngineRequest,
        loaded: ReadOutcome,
        t_start: float,
        alloc_wait_s: float,
        writeback: WriteBack | None,
    ) -> None:
        self.seam = seam
        self.req = engine_req
        self.loaded = loaded
        self.t_start = t_start
        self.alloc_wait_s = alloc_wait_s
        self.writeback = writeback
        self.handed_over = False

    def on_close(self) -> None:
        if not self.handed_over and self.req.preallocated_block_ids:
            with contextlib.suppress(Exception):  # a dead engine has no blocks to give back
                self.seam.engine.free_blocks(self.req.preallocated_block_ids)

    async def events(self) -> AsyncIterator[bytes]:
        status = "aborted"
        num_out = len(self.req.output_token_ids)
        new_ids: list[int] = []
        ttft_s = None
        try:
            outputs = self.seam.engine.generate(self.req)
            async with contextlib.aclosing(outputs):
                # No await between here and the first __anext__, which adds the request: from
                # now on the engine owns the blocks (and frees them on abort).
                self.handed_over = True
                async for out in outputs:
                    num_out = out.num_output_tokens
                    new_ids.extend(out.new_token_ids)
                    if ttft_s is None and out.new_token_ids:
                        ttft_s = time.monotonic() - self.t_start
                    yield decode_event_sse(self._event(out, ttft_s))
            status = "success"
            if self.writeback is not None:  # after the last event: off the token path
                req = self.req
                tokens = (*req.prompt_token_ids, *req.output_token_ids, *new_ids)
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
            self.seam.server_metrics.observe_request(
                "decode",
                status,
                num_generated_tokens=num_out - len(self.req.output_token_ids),
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
        if out.finished:
            event = event.model_copy(update=self._final_fields(ttft_s))
        return event

    def _final_fields(self, ttft_s: float | None) -> dict[str, Any]:
        num_prompt = len(self.req.prompt_token_ids)
        return {
            "num_blocks_loaded": self.loaded.num_loaded,
            "num_tokens_recomputed": num_prompt - self.req.num_computed_tokens,
            "num_bytes_read": self.loaded.num_bytes,
            "timings": DecodeTimings(
                alloc_wait_s=self.alloc_wait_s,
                get_s=self.loaded.timings.get_s,
                h2d_s=self.loaded.timings.h2d_s,
                ttft_s=ttft_s or 0.0,
            ),
        }
