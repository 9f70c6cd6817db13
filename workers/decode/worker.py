"""The decode role: POST /internal/decode loads the prompt's KV from the pool and continues.

    allocate blocks for the prompt (bounded wait, else 503)
    for each batch of keys: get_into staging slots; swap_cache_layout host -> device for the
        blocks read, stopping at the first block the pool does not have
    missing blocks:  policy `recompute` -> free the unfilled blocks; the engine recomputes
                     tokens [num_loaded, ...) itself.   policy `fail` -> 502 naming them
    EngineRequest(output_token_ids=tokens the client has, preallocated_block_ids=filled
        blocks, num_computed_tokens=tokens loaded) joins the running batch; its tokens stream
        back as SSE DecodeEvents. Closing the stream aborts the request (blocks freed).
    after the last event: prompt + output blocks the pool lacks are written back in the
        background (writeback.py), so the next chat turn hits them on any P

Block ownership: ours from allocate_blocks() until the engine request is added (the first
iteration of generate()); every path before that frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdrouter.wire.errors import APIError, bad_request, unavailable
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import (
    DECODE_PATH,
    DecodeEvent,
    DecodeRequest,
    DecodeTimings,
    StageError,
    StageErrorBody,
    decode_event_sse,
)
from pdrouter.wire.responses import SSE_HEADERS, sse_error
from workers.decode.handoff_reader import load_blocks
from workers.decode.writeback import WriteBack
from workers.engine.api import EngineRequest, SamplingParams
from workers.pool.keys import block_keys
from workers.server.app import STATUS_CLIENT_CLOSED
from workers.server.config import WorkerConfig
from workers.server.logprobs import wire_logprobs
from workers.server.pd_worker import (
    PDContext,
    build_pd_app,
    unless_disconnected,
)
from workers.server.prepare import check_model_name, fit_max_tokens, sampling_params
from workers.server.streaming import ClosingStreamingResponse
from workers.server.tasks import finish_in_thread

log = logging.getLogger(__name__)


def decode_params(ctx: PDContext, req: DecodeRequest) -> SamplingParams:
    """The SamplingParams P ran with, from the same body and P's prompt token ids.

    P is the tokenizer of record: D never templates or tokenizes the prompt again, it sizes
    max_tokens from len(prompt_token_ids) exactly as prepare_request did on P.
    """
    request_cls = ChatCompletionRequest if req.endpoint == "chat" else CompletionRequest
    parsed = parse_request(request_cls, json.dumps(req.body).encode())
    check_model_name(parsed.model, ctx.worker.config.served_model_names)
    if isinstance(parsed, ChatCompletionRequest):
        requested, param = parsed.requested_max_tokens(), "messages"
    else:
        requested, param = parsed.max_tokens, "prompt"
    max_len = ctx.engine.engine_config.max_model_len
    max_tokens = fit_max_tokens(len(req.prompt_token_ids), requested, max_len, param)
    return sampling_params(parsed, max_tokens)


async def allocate_blocks(ctx: PDContext, num_blocks: int) -> list[int]:
    """num_blocks engine blocks within the bound, else 503 (the router tries another D)."""
    engine = ctx.engine
    deadline_s = time.monotonic() + ctx.settings.wait_s
    delay_s = 0.002
    while True:
        block_ids = engine.allocate_blocks(num_blocks)
        if block_ids is not None:
            return list(block_ids)
        if time.monotonic() + delay_s > deadline_s:
            raise unavailable(
                f"no {num_blocks} free KV blocks within {ctx.settings.wait_s:.0f}s", "kv_full"
            )
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.05)


def _check_handle(ctx: PDContext, req: DecodeRequest) -> list[str]:
    """The keys to read: recomputed from the prompt and checked against P's handle."""
    if req.kv is None:
        return []
    if req.kv.fingerprint != ctx.fingerprint or req.kv.block_size != ctx.block_size:
        raise bad_request(
            f"KV handle of fingerprint {req.kv.fingerprint} (block size {req.kv.block_size}) "
            f"cannot load into this decode worker ({ctx.fingerprint}, block size "
            f"{ctx.block_size})",
            "kv",
        )
    keys = block_keys(ctx.fingerprint, req.prompt_token_ids, ctx.block_size)
    if req.kv.keys != keys or req.kv.num_tokens != len(req.prompt_token_ids):
        raise bad_request("KV handle keys do not match prompt_token_ids", "kv")
    return keys


async def start_decode(
    ctx: PDContext, req: DecodeRequest, writeback: WriteBack | None = None
) -> Response:
    """Load KV, then answer a stream of DecodeEvents (or 4xx/502/503 before any event)."""
    t_start = time.monotonic()
    engine = ctx.engine
    params = decode_params(ctx, req)
    keys = _check_handle(ctx, req)
    timings = {"get_s": 0.0, "h2d_s": 0.0}
    block_ids = await allocate_blocks(ctx, len(keys)) if keys else []
    t_alloc = time.monotonic()
    owned = list(block_ids)  # blocks still ours to free
    try:
        loaded, missing, num_bytes = (0, [], 0)
        if keys:
            loaded, missing, num_bytes = await finish_in_thread(
                load_blocks, ctx, keys, block_ids, timings
            )
        policy = req.missing_kv_policy or ctx.settings.missing_kv_policy
        if missing and policy == "fail":
            ctx.metrics.blocks_missing.inc(len(keys) - loaded)
            message = (
                f"{len(keys) - loaded} of {len(keys)} KV blocks could not be read from the pool "
                f"(policy fail); first missing: {', '.join(missing[:8])}"
            )
            body = StageErrorBody(error=StageError(message=message, missing_keys=missing))
            owned = []
            engine.free_blocks(block_ids)
            return JSONResponse(body.model_dump(), status_code=502)
        engine.free_blocks(block_ids[loaded:])
        owned = block_ids[:loaded]
        num_prompt = len(req.prompt_token_ids)
        num_computed = min(loaded * ctx.block_size, num_prompt)
        engine_req = EngineRequest(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            params=params,
            output_token_ids=tuple(req.output_token_ids),
            preallocated_block_ids=tuple(owned),
            num_computed_tokens=num_computed,
        )
        try:
            engine.validate(engine_req)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    except BaseException:
        if owned:
            engine.free_blocks(owned)
        raise
    log.info(
        "decode %s: %d of %d blocks loaded, %d prompt tokens to recompute",
        req.request_id,
        loaded,
        len(keys),
        num_prompt - num_computed,
    )
    # D's load of P's handoff is not a cache hit (usage's cached_tokens comes from P).
    ctx.worker.metrics.count_prompt_sources(
        handoff=num_computed, computed=num_prompt - num_computed
    )
    m = ctx.metrics
    m.bytes_read.inc(num_bytes)
    m.blocks_loaded.inc(loaded)
    m.blocks_missing.inc(len(keys) - loaded)
    m.tokens_recomputed.inc(num_prompt - num_computed)
    m.get_s.observe(timings["get_s"])
    m.h2d_s.observe(timings["h2d_s"])
    final_extra = {
        "num_blocks_loaded": loaded,
        "num_tokens_recomputed": num_prompt - num_computed,
        "num_bytes_read": num_bytes,
    }
    stream = _DecodeStream(ctx, engine_req, t_start, t_alloc - t_start, timings, final_extra)
    stream.writeback = writeback
    return ClosingStreamingResponse(stream.events(), on_close=stream.on_close, headers=SSE_HEADERS)


class _DecodeStream:
    """The SSE body of one decode request; frees its blocks if it never reached the engine."""

    def __init__(
        self,
        ctx: PDContext,
        engine_req: EngineRequest,
        t_start: float,
        alloc_wait_s: float,
        timings: dict[str, float],
        final_extra: dict[str, Any],
    ) -> None:
        self.ctx = ctx
        self.req = engine_req
        self.t_start = t_start
        self.alloc_wait_s = alloc_wait_s
        self.timings = timings
        self.final_extra = final_extra
        self.handed_over = False
        self.writeback: WriteBack | None = None

    def on_close(self) -> None:
        if not self.handed_over and self.req.preallocated_block_ids:
            self.ctx.worker.engine.free_blocks(list(self.req.preallocated_block_ids))

    async def events(self) -> AsyncIterator[bytes]:
        engine = self.ctx.worker.engine
        status = "aborted"
        num_out = len(self.req.output_token_ids)
        new_ids: list[int] = []
        ttft_s = None
        with_logprobs = self.req.params.num_logprobs is not None
        try:
            outputs = engine.generate(self.req)
            async with contextlib.aclosing(outputs):
                # No await between here and the first __anext__, which adds the request: from
                # now on the engine owns the blocks (and frees them on abort).
                self.handed_over = True
                async for out in outputs:
                    num_out = out.num_output_tokens
                    new_ids.extend(out.new_token_ids)
                    if ttft_s is None and out.new_token_ids:
                        ttft_s = time.monotonic() - self.t_start
                    event = DecodeEvent(
                        token_ids=list(out.new_token_ids),
                        text=out.new_text,
                        finished=out.finished,
                        finish_reason=out.finish_reason if out.finished else None,
                        num_output_tokens=out.num_output_tokens,
                        logprobs=(
                            wire_logprobs(engine.tokenizer, out.new_logprobs)
                            if with_logprobs
                            else None
                        ),
                    )
                    if out.finished:
                        event = event.model_copy(update=self._final_fields(ttft_s))
                    yield decode_event_sse(event)
            status = "success"
            if self.writeback is not None:  # after the last event: off the token path
                req = self.req
                tokens = (*req.prompt_token_ids, *req.output_token_ids, *new_ids)
                self.writeback.submit(req.request_id, tokens)
        except APIError as exc:
            status = "error"
            yield sse_error(exc.message)
        except Exception:
            log.exception("decode of %s failed mid-stream", self.req.request_id)
            status = "error"
            yield sse_error("the decode engine failed while generating; see the worker log")
        finally:
            self.ctx.worker.metrics.observe_request(
                "decode",
                status,
                num_generated_tokens=num_out - len(self.req.output_token_ids),
                ttft_s=ttft_s,
            )

    def _final_fields(self, ttft_s: float | None) -> dict[str, Any]:
        return {
            **self.final_extra,
            "timings": DecodeTimings(
                alloc_wait_s=self.alloc_wait_s,
                get_s=self.timings["get_s"],
                h2d_s=self.timings["h2d_s"],
                ttft_s=ttft_s or 0.0,
            ),
        }


def install_decode_routes(app: FastAPI, ctx: PDContext) -> None:
    settings = ctx.settings
    writeback = WriteBack(ctx, settings.writeback_max_in_flight) if settings.writeback else None

    @app.post(DECODE_PATH)
    async def decode(request: Request) -> Response:
        try:
            req = DecodeRequest.model_validate_json(await request.body())
        except ValueError as exc:
            raise bad_request(f"malformed decode request: {exc}") from None
        response = await unless_disconnected(request, start_decode(ctx, req, writeback))
        return Response(status_code=STATUS_CLIENT_CLOSED) if response is None else response


def build_decode_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> FastAPI:
    """`pdworker serve --role decode`: the worker app with POST /internal/decode."""
    return build_pd_app(cfg, on_failure, install_decode_routes)
