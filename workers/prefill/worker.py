"""The prefill role: POST /internal/prefill runs the prompt, samples the first token and writes
the prompt's KV blocks to the pool.

    parse + template + tokenize + validate   (P is the tokenizer of record)
    prefix: device hits + the following blocks the pool holds, read into a lease
            (pool_prefix.py); the engine computes only the rest
    engine: EngineRequest(prefill_only=True) batched with the other requests -> first token,
            block_ids (kept until release)
    for each batch of blocks not yet in the pool (full blocks and the partial last one):
        swap_cache_layout device -> host into staging slots; put_from(keys, slots)
        with chunked prefill, the blocks of each finished chunk are written while the next
        chunk computes (report_progress events; handoff_writer.ChunkedWrite)
    wait for every write, release the blocks and the slots (finally), answer PrefillResult

A pool that fails a put does not fail the request: the handle lists every key and the decode
worker recomputes what it cannot read (or answers 502 under the `fail` policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdrouter.wire.errors import bad_request
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import (
    PREFILL_PATH,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    PrefillTimings,
)
from workers.engine.api import EngineRequest, SamplingParams
from workers.pool.keys import block_keys
from workers.prefill.handoff_writer import ChunkedWrite
from workers.prefill.pool_prefix import acquire_pool_prefix
from workers.server.app import STATUS_CLIENT_CLOSED
from workers.server.config import WorkerConfig
from workers.server.logprobs import wire_logprobs
from workers.server.pd_worker import (
    PDContext,
    build_pd_app,
    unless_disconnected,
)
from workers.server.prepare import PreparedRequest, check_model_name, prepare_request

log = logging.getLogger(__name__)


def prepare_pd_request(ctx: PDContext, endpoint: str, body: dict[str, Any], request_id: str):
    """The OpenAI body as the engine will run it; the same function on P and on D."""
    engine = ctx.engine
    request_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    parsed = parse_request(request_cls, json.dumps(body).encode())
    check_model_name(parsed.model, ctx.worker.config.served_model_names)
    return prepare_request(parsed, request_id, engine.tokenizer, engine.engine_config.max_model_len)


def first_token_finish(
    token_id: int,
    text: str,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
) -> tuple[str | None, str]:
    """(finish reason, text) when the first token already ends the request, else (None, text).

    The engine ends a prefill_only request with "prefill_done" whatever the token; the stop
    rules the decode engine would apply to it are applied here, so that a request that is
    over after one token never takes a decode hop.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop", ""
    full_text = decode([token_id])
    for stop in params.stop:
        cut = full_text.find(stop)
        if cut >= 0:
            return "stop", full_text[:cut]
    if params.max_tokens <= 1:
        return "length", text
    return None, text


async def run_prefill(ctx: PDContext, req: PrefillRequest, request_id: str) -> PrefillResult:
    """Prefill one request and write its KV; the engine's blocks are released in any case."""
    t_start = time.monotonic()
    engine = ctx.engine
    # Template and tokenize on the CPU threads: the event loop keeps serving /health.
    prepared: PreparedRequest = await ctx.worker.cpu.run(
        prepare_pd_request, ctx, req.endpoint, req.body, request_id
    )
    engine_req = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prepared.prompt_token_ids,
        params=prepared.params,
        prefill_only=True,
        report_progress=ctx.settings.write_while_computing,
    )
    try:
        engine.validate(engine_req)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    keys = block_keys(ctx.fingerprint, prepared.prompt_token_ids, ctx.block_size)
    prefix = await acquire_pool_prefix(ctx, prepared.prompt_token_ids, keys)
    lease = prefix.lease
    if lease is not None:
        engine_req = dataclasses.replace(
            engine_req,
            preallocated_block_ids=lease.block_ids,
            num_computed_tokens=lease.num_computed_tokens,
            num_cached_tokens=lease.num_computed_tokens,
        )
    writer = ChunkedWrite(ctx, keys)
    token_ids: list[int] = []
    text_parts: list[str] = []
    logprobs: list[Any] = []
    block_ids: tuple[int, ...] = ()
    num_cached = 0
    status = "error"
    try:
        try:
            stream = engine.generate(engine_req)
        except BaseException:
            if lease is not None:  # refused before the engine took it: still ours
                engine.release_lease(lease)
            raise
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                if out.ready_block_ids:  # a chunk's blocks: out while the next one computes
                    writer.add(out.ready_from_block, out.ready_block_ids)
                token_ids.extend(out.new_token_ids)
                text_parts.append(out.new_text)
                logprobs.extend(out.new_logprobs)
                num_cached = out.num_cached_tokens
                if out.finished:
                    block_ids = out.block_ids
        t_first = time.monotonic()
        if not token_ids:
            raise RuntimeError(f"prefill of {request_id} ended without a token")
        first = token_ids[0]
        tokenizer = engine.tokenizer
        finish, first_text = first_token_finish(
            first,
            "".join(text_parts),
            prepared.params,
            tuple(tokenizer.eos_token_ids),
            tokenizer.decode,
        )
        kv = None
        num_early = writer.next_block
        if finish is None:
            if len(block_ids) < len(keys):
                raise RuntimeError(
                    f"engine returned {len(block_ids)} blocks for {len(keys)} prompt blocks"
                )
            writer.add(num_early, block_ids[num_early : len(keys)])
        written, skipped, num_bytes = await writer.finish()
        t_written = time.monotonic()
        if finish is None:
            kv = KVHandle(
                fingerprint=ctx.fingerprint,
                block_size=ctx.block_size,
                num_tokens=len(prepared.prompt_token_ids),
                keys=keys,
            )
        status = "success"
    except asyncio.CancelledError:
        status = "aborted"  # the router left; generate() aborted the engine request
        raise
    finally:
        # Blocks go back once every write has ended (or failed): never kept past the answer,
        # never freed under a copy still reading them (finish() waits through a cancellation).
        with contextlib.suppress(Exception):
            await writer.finish()
        with contextlib.suppress(Exception):
            engine.release(request_id)
        ctx.worker.metrics.observe_request(
            "prefill",
            status,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            num_generated_tokens=len(token_ids),
        )
    log.info(
        "prefill %s: %d prompt tokens (%d cached, %d of them from the pool), first token %d, "
        "finish %s, %d blocks written, %d skipped; %d handed over during the prefill",
        request_id,
        len(prepared.prompt_token_ids),
        num_cached,
        prefix.num_pool_tokens,
        first,
        finish,
        written,
        skipped,
        num_early,
    )
    num_prompt = len(prepared.prompt_token_ids)
    num_pool = prefix.num_pool_tokens
    ctx.worker.metrics.count_prompt_sources(
        device=num_cached - num_pool, pool=num_pool, computed=num_prompt - num_cached
    )
    m = ctx.metrics
    m.bytes_written.inc(num_bytes)
    m.blocks_written.inc(written)
    m.blocks_skipped.inc(skipped)
    m.compute_s.observe(t_first - t_start)
    m.d2h_s.observe(writer.timings["d2h_s"])
    m.put_s.observe(writer.timings["put_s"])
    m.write_wait_s.observe(t_written - t_first)
    m.blocks_written_early.inc(num_early)
    return PrefillResult(
        request_id=request_id,
        prompt_token_ids=list(prepared.prompt_token_ids),
        first_token_id=first,
        first_text=first_text,
        first_logprobs=(
            None
            if prepared.params.num_logprobs is None
            else wire_logprobs(engine.tokenizer, logprobs[:1])
        ),
        finish_reason=finish,
        kv=kv,
        num_blocks_written=written,
        num_blocks_skipped=skipped,
        num_bytes_written=num_bytes,
        num_cached_tokens=num_cached,
        num_pool_cached_tokens=num_pool,
        timings=PrefillTimings(
            queue_compute_s=t_first - t_start,
            d2h_s=writer.timings["d2h_s"],
            put_s=writer.timings["put_s"],
            write_wait_s=t_written - t_first,
            pool_lookup_s=prefix.lookup_s,
            pool_load_s=prefix.load_s,
            total_s=time.monotonic() - t_start,
        ),
    )


def install_prefill_routes(app: FastAPI, ctx: PDContext) -> None:
    @app.post(PREFILL_PATH)
    async def prefill(request: Request) -> Response:
        try:
            req = PrefillRequest.model_validate_json(await request.body())
        except ValueError as exc:
            raise bad_request(f"malformed prefill request: {exc}") from None
        result = await unless_disconnected(request, run_prefill(ctx, req, req.request_id))
        if result is None:  # the router gave up (its client left): the request was aborted
            return Response(status_code=STATUS_CLIENT_CLOSED)
        return JSONResponse(result.model_dump())


def build_prefill_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> FastAPI:
    """`pdworker serve --role prefill`: the worker app with POST /internal/prefill."""
    return build_pd_app(cfg, on_failure, install_prefill_routes)
