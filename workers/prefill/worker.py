"""The prefill role: POST /internal/prefill runs the prompt, samples the first token and writes
the prompt's KV blocks to the pool.

    prepare   parse + template + tokenize + validate (P is the tokenizer of record)
    decide    fewer uncached prompt tokens than the router's threshold: answer LocalPrefill
              at once, D prefills the prompt itself (local_decision.py)
    lease     device hits + the following blocks the pool holds, read into a lease
              (workers/handoff/pool_prefix.py); the engine computes only the rest
    generate  EngineRequest(prefill_only=True) batched with the other requests -> first
              token, block_ids (kept until release); with chunked prefill, the blocks of each
              finished chunk are written while the next chunk computes (ChunkedWrite)
    write     the rest of the blocks not yet in the pool: swap_cache_layout device -> host
              into staging slots, put_from(keys, slots); wait for every write
    result    release the blocks (finally, after every write ended), answer PrefillResult

The stages are in stages.py. A pool that fails a put does not fail the request: the handle
lists every key and the decode worker recomputes what it cannot read (or answers 502 under
the `fail` policy).
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
from pdrouter.wire.pd import (
    PREFILL_PATH,
    LocalPrefill,
    PrefillRequest,
    PrefillResult,
    PrefillTimings,
)
from workers.handoff.pool_prefix import PoolPrefix
from workers.handoff.writer import ChunkedWrite
from workers.prefill import local_decision, prompt_anchors, stages
from workers.prefill.stages import Generated, PrefillPlan, RefusedByEngine, Written
from workers.server.app import STATUS_CLIENT_CLOSED
from workers.server.cache_events_api import install_cache_event_routes
from workers.server.config import WorkerConfig
from workers.server.pd_worker import (
    PDRole,
    PDSeam,
    build_pd_app,
    read_message,
    unless_disconnected,
)

log = logging.getLogger(__name__)


async def run_prefill(
    seam: PDSeam, req: PrefillRequest, request_id: str
) -> PrefillResult | LocalPrefill:
    """Prefill one request and write its KV; the engine's blocks are released in any case.
    A prompt whose uncached part is under the request's threshold is left to D instead."""
    t_start = time.monotonic()
    plan = await stages.prepare(seam, req, request_id)
    # A scored prompt (echo) is P's to compute: its text and logprobs come back with the result.
    # A group is decoded on D from P's first tokens: never left to D either.
    group = bool(plan.engine_req.sequence_seeds)
    threshold = 0 if plan.prepared.scoring or group else req.local_prefill_below_tokens
    local = await local_decision.decide(seam, plan, threshold)
    if local is not None:
        return local  # nothing computed, nothing held (the router counts the decision)
    prompt_anchors.publish_soon(seam, req, plan)
    pool = seam.open_pool()
    plan, prefix = await stages.lease(seam, plan)
    settings = seam.settings
    writer = ChunkedWrite(
        pool,
        seam.engine.kv_caches,
        plan.keys,
        group_blocks=settings.transfer_batch_blocks,
        wait_s=settings.wait_s,
        priority=plan.engine_req.params.priority,  # its parts go before less urgent ones
    )
    status, num_generated, in_engine = "error", 0, True
    try:
        generated = await stages.generate(seam, plan, prefix, writer, t_start)
        # A group's other sequences sample their first tokens here too.
        num_generated = len(generated.token_ids) + sum(
            o.num_output_tokens for o in generated.others
        )
        written = await stages.write(seam, plan, generated, writer)
        status = "success"
    except RefusedByEngine as exc:
        in_engine = False  # the id belongs to another request: its blocks are not ours
        raise exc.api_error from None
    except asyncio.CancelledError:
        status = "aborted"  # the router left; generate() aborted the engine request
        raise
    finally:
        # Blocks go back once every write has ended (or failed): never kept past the answer,
        # never freed under a copy still reading them (finish() waits through a cancellation).
        with contextlib.suppress(Exception):
            await writer.finish()
        if in_engine:
            with contextlib.suppress(Exception):
                seam.engine.release(request_id)
        seam.server_metrics.observe_request(
            "prefill",
            status,
            num_prompt_tokens=plan.num_prompt_tokens,
            num_generated_tokens=num_generated,
        )
    return result(seam, plan, prefix, generated, written, t_start)


def result(
    seam: PDSeam,
    plan: PrefillPlan,
    prefix: PoolPrefix,
    generated: Generated,
    written: Written,
    t_start: float,
) -> PrefillResult:
    """The metrics of a prefill that succeeded, and its answer."""
    num_prompt, num_pool = plan.num_prompt_tokens, prefix.num_pool_tokens
    num_cached, outcome = generated.num_cached_tokens, written.outcome
    log.info(
        "prefill %s: %d prompt tokens (%d cached, %d of them from the pool), first token %d, "
        "finish %s, %d blocks written, %d skipped; %d handed over during the prefill",
        plan.engine_req.request_id,
        num_prompt,
        num_cached,
        num_pool,
        generated.token_ids[0],
        written.finish_reason,
        outcome.num_written,
        outcome.num_skipped,
        written.num_early_blocks,
    )
    num_host = min(generated.num_host_cached_tokens, num_cached - num_pool)
    seam.server_metrics.count_prompt_sources(
        device=num_cached - num_pool - num_host,
        host=num_host,
        pool=num_pool,
        computed=num_prompt - num_cached,
    )
    m = seam.metrics
    m.bytes_written.inc(outcome.num_bytes)
    m.blocks_written.inc(outcome.num_written)
    m.blocks_skipped.inc(outcome.num_skipped)
    m.compute_s.observe(generated.compute_s)
    m.d2h_s.observe(outcome.timings.d2h_s)
    m.put_s.observe(outcome.timings.put_s)
    m.write_wait_s.observe(written.wait_s)
    m.blocks_written_early.inc(written.num_early_blocks)
    return PrefillResult(
        request_id=plan.engine_req.request_id,
        prompt_token_ids=list(plan.prepared.prompt_token_ids),
        first_token_id=generated.token_ids[0],
        first_text=written.first_text,
        first_logprobs=stages.first_logprobs(seam, plan, generated),
        echo=stages.echoed(seam, plan, generated),
        finish_reason=written.finish_reason,  # type: ignore[arg-type]  # stop | length | None
        kv=written.kv,
        num_blocks_written=outcome.num_written,
        num_blocks_skipped=outcome.num_skipped,
        num_bytes_written=outcome.num_bytes,
        num_cached_tokens=num_cached,
        num_pool_cached_tokens=num_pool,
        num_host_cached_tokens=num_host,
        sequences=stages.other_first_tokens(seam, plan, generated, written),
        timings=PrefillTimings(
            queue_compute_s=generated.compute_s,
            engine_queue_s=generated.engine_queue_s,
            engine_compute_s=generated.engine_compute_s,
            d2h_s=outcome.timings.d2h_s,
            put_s=outcome.timings.put_s,
            write_wait_s=written.wait_s,
            pool_lookup_s=prefix.lookup_s,
            pool_load_s=prefix.load_s,
            total_s=time.monotonic() - t_start,
        ),
    )


def install_prefill_routes(app: FastAPI, role: PDRole) -> None:
    @app.post(PREFILL_PATH)
    async def prefill(request: Request) -> Response:
        seam = role.seam()
        req = await read_message(request, PrefillRequest, "prefill request")
        result = await unless_disconnected(request, run_prefill(seam, req, req.request_id))
        if result is None:  # the router gave up (its client left): the request was aborted
            return Response(status_code=STATUS_CLIENT_CLOSED)
        tracer = request.app.state.tracer
        if tracer is not None and isinstance(result, PrefillResult):
            tracer.prefill(request.headers.get(TRACEPARENT), result)
        return JSONResponse(result.model_dump())

    install_cache_event_routes(app, lambda: role.seam().engine)


def build_prefill_app(cfg: WorkerConfig, on_failure: Callable[[BaseException], None]) -> FastAPI:
    """`pdworker serve --role prefill`: the worker app with POST /internal/prefill."""
    return build_pd_app(cfg, on_failure, install_prefill_routes)
