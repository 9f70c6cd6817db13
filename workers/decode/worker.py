"""The decode role: POST /internal/decode loads the prompt's KV from the pool and continues.

    check     P's sampling params from the body; the KV handle          else 400
              (no handle: D prefills the prompt itself over its cached prefix,
              local_prefill.py; P left it to D, or it resumes such a request)
    allocate  blocks for the prompt (bounded wait)                      else 503 kv_full
    load      the handle's keys read into them, up to the first miss    (503 staging_full)
    admit     missing blocks: `recompute` frees the unfilled ones (the engine recomputes
              tokens [num_loaded, ...)), `fail` answers 502 naming them
              EngineRequest(output_token_ids=tokens the client has, preallocated_block_ids=
              filled blocks, num_computed_tokens=tokens loaded) handed to the engine, its
              first output awaited; an id the engine holds                else 400
    stream    the request's tokens stream back as SSE DecodeEvents; then the blocks are
              written back

With a prefetch of the same request (POST /internal/prefetch, sent by the router beside P's
prefill: workers/decode/prefetch.py), allocate and most of load already happened: the decode
adopts the reservation, waits for its follow to stop and reads only what is left.

The stages are in stages.py and stream.py. Block ownership: ours from allocate until the
engine takes the request (stages.hand_over); every path before that frees them, and after
it closing the engine stream (also a response never read) aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdrouter.common.tracing import TRACEPARENT
from pdrouter.wire.pd import DECODE_PATH, PREFETCH_PATH, DecodeRequest, PrefetchRequest
from pdrouter.wire.responses import SSE_HEADERS
from workers.decode import local_prefill, stages
from workers.decode.prefetch import Prefetches
from workers.decode.stream import DecodeStream, StreamTiming
from workers.handoff.pool_prefix import PoolPrefix
from workers.handoff.reader import ReadOutcome
from workers.handoff.writeback import WriteBack
from workers.server.app import STATUS_CLIENT_CLOSED
from workers.server.config import WorkerConfig
from workers.server.pd_worker import (
    PDRole,
    PDSeam,
    build_pd_app,
    read_message,
    unless_disconnected,
)
from workers.server.streaming import ClosingStreamingResponse
from workers.server.structured import with_matcher

log = logging.getLogger(__name__)


async def start_decode(
    seam: PDSeam,
    req: DecodeRequest,
    writeback: WriteBack | None = None,
    prefetches: Prefetches | None = None,
) -> Response:
    """Load KV (the rest of it, when a prefetch of the request read ahead; without a handle,
    take the prompt's cached prefix: local_prefill.py), hand the request to the engine and
    await its first output, then answer a stream of DecodeEvents (or 4xx/502/503 before any
    event)."""
    t_start = time.monotonic()
    keys = stages.check_handle(seam.identity, req)  # a cheap 400 before any grammar compile
    params = await stages.decode_params(seam, req)
    adopted = prefetches.take(seam, req, keys) if prefetches is not None else None
    if adopted is None:
        block_ids = await stages.allocate(seam, len(keys), params.priority)
    else:
        block_ids = adopted.block_ids  # ours from take() on
    alloc_wait_s = time.monotonic() - t_start
    owned = list(block_ids)  # blocks still ours to free
    prefix: PoolPrefix | None = None  # without a handle: the prompt's cached prefix
    lease_ours = False  # its lease, ours until the engine takes the request
    in_engine = False  # from here on the request is counted, as its stream would have been
    ahead_n: int | None = None  # of the blocks loaded, those the prefetch read ahead
    try:
        if adopted is None or prefetches is None:
            loaded = await stages.load(seam, keys, block_ids, params.priority)
        else:
            loaded, ahead_n = await prefetches.read_rest(seam, adopted, keys)
        policy = req.missing_kv_policy or seam.settings.missing_kv_policy
        if loaded.missing_keys and policy == "fail":
            seam.metrics.blocks_missing.inc(len(keys) - loaded.num_loaded)
            body = stages.missing_blocks_error(len(keys), loaded)
            owned = []
            seam.engine.free_blocks(block_ids)
            return JSONResponse(body.model_dump(), status_code=502)
        owned = block_ids[: loaded.num_loaded]  # admit frees the rest first
        engine_req = stages.admit(seam, req, params, block_ids, loaded)
        engine_req = await with_matcher(engine_req, seam.engine, seam.cpu)
        if req.kv is None:
            prefix = await local_prefill.prompt_prefix(seam, req)
            lease_ours = prefix.lease is not None
            engine_req = local_prefill.over_prefix(engine_req, prefix)
        else:
            observe_load(seam, req, len(keys), loaded, engine_req.num_computed_tokens)
        in_engine = True
        outputs = stages.hand_over(seam, engine_req)
        owned, lease_ours = [], False  # the engine's now, also if it refuses it in its thread
        first = await stages.first_output(outputs)  # outputs is closed if this raises
    except BaseException as exc:
        if owned:
            with contextlib.suppress(Exception):  # a dead engine has no blocks to give back
                seam.engine.free_blocks(owned)
        if lease_ours and prefix is not None and prefix.lease is not None:
            with contextlib.suppress(Exception):
                seam.engine.release_lease(prefix.lease)
        if in_engine:
            cancelled = isinstance(exc, asyncio.CancelledError)
            seam.server_metrics.observe_request("decode", "aborted" if cancelled else "error")
        raise
    if prefix is not None:
        local_prefill.observe_prefill(seam, req, first, prefix)
    timing = StreamTiming(t_start, alloc_wait_s, first_s=time.monotonic())
    numbers = tuple(s.index for s in req.sequences or ())
    stream = DecodeStream(
        seam, engine_req, outputs, first, loaded, timing, writeback, prefix, ahead_n, numbers
    )
    # aclose() (which ClosingStreamingResponse always awaits) aborts a stream never read.
    return ClosingStreamingResponse(stream, on_close=lambda: None, headers=SSE_HEADERS)


def observe_load(
    seam: PDSeam, req: DecodeRequest, num_keys: int, loaded: ReadOutcome, num_computed: int
) -> None:
    """Log and count how the prompt's KV was obtained."""
    num_loaded = loaded.num_loaded
    num_prompt = len(req.prompt_token_ids)
    log.info(
        "decode %s: %d of %d blocks loaded, %d prompt tokens to recompute",
        req.request_id,
        num_loaded,
        num_keys,
        num_prompt - num_computed,
    )
    # D's load of P's handoff is not a cache hit (usage's cached_tokens comes from P).
    seam.server_metrics.count_prompt_sources(
        handoff=num_computed, computed=num_prompt - num_computed
    )
    m = seam.metrics
    m.bytes_read.inc(loaded.num_bytes)
    m.blocks_loaded.inc(num_loaded)
    m.blocks_missing.inc(num_keys - num_loaded)
    m.tokens_recomputed.inc(num_prompt - num_computed)
    m.get_s.observe(loaded.timings.get_s)
    m.h2d_s.observe(loaded.timings.h2d_s)


def install_decode_routes(app: FastAPI, role: PDRole) -> None:
    settings = role.settings
    writeback = None
    if settings.writeback:
        writeback = WriteBack(
            settings.writeback_max_in_flight,
            role.cache_metrics,
            role.metrics.bytes_written,
            role.background,
        )

    prefetches = Prefetches(role.worker.metrics.registry)

    @app.post(DECODE_PATH)
    async def decode(request: Request) -> Response:
        seam = role.seam()
        req = await read_message(request, DecodeRequest, "decode request")
        work = start_decode(seam, req, writeback, prefetches)
        response = await unless_disconnected(request, work)
        tracer = request.app.state.tracer
        if tracer is not None and isinstance(response, ClosingStreamingResponse):
            tracer.decode_on_close(request.headers.get(TRACEPARENT), response)
        return Response(status_code=STATUS_CLIENT_CLOSED) if response is None else response

    @app.post(PREFETCH_PATH, status_code=202)
    async def prefetch(request: Request) -> Response:
        seam = role.seam()
        start_s = time.monotonic()
        req = await read_message(request, PrefetchRequest, "prefetch request")
        answer = await prefetches.reserve(seam, req)
        tracer = request.app.state.tracer
        if tracer is not None:
            tracer.prefetch(request.headers.get(TRACEPARENT), start_s, answer)
        return JSONResponse(answer.model_dump(), status_code=202)

    @app.delete(PREFETCH_PATH + "/{request_id}", status_code=204)
    async def release_prefetch(request_id: str) -> Response:
        await prefetches.release(role.seam(), request_id)  # idempotent: none held is fine
        return Response(status_code=204)


def build_decode_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> FastAPI:
    """`pdworker serve --role decode`: the worker app with POST /internal/decode."""
    return build_pd_app(cfg, on_failure, install_decode_routes)
