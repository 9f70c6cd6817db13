"""What the end of a request records (RouterService._end): for an answer, the token counters,
the end-to-end and per-token times, an INFO line and its timeline closed at 200; for an
error, the 429s by stage, a line (WARNING from 500 on) and its timeline closed with the
status, stage and message. The router runs uvicorn without an access log: these lines are it.
"""

from __future__ import annotations

import logging

from pdrouter.router.observability.metrics import RouterMetrics
from pdrouter.router.orchestrator import RequestContext
from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import Endpoint

logger = logging.getLogger("pdrouter.router.service")


def record_error(
    metrics: RouterMetrics,
    request_id: str,
    endpoint: Endpoint,
    ctx: RequestContext | None,
    error: APIError,
) -> None:
    if error.status == 429:
        metrics.rejected.labels(error.stage).inc()
    level = logging.WARNING if error.status >= 500 else logging.INFO
    logger.log(
        level, "request %s: %s answered %d: %s", request_id, endpoint, error.status, error.message
    )
    if ctx is not None and ctx.timeline is not None:
        ctx.timeline.end(error.status, stage=error.stage, error=error.message)


def record_answer(metrics: RouterMetrics, request_id: str, ctx: RequestContext) -> None:
    n_prompt, n_out, t_first = ctx.num_prompt_tokens, ctx.num_output_tokens, ctx.first_token_s
    metrics.prompt_tokens.inc(n_prompt)
    metrics.generation_tokens.inc(n_out)
    metrics.e2e_s.observe(ctx.answered_s - ctx.arrival_s)
    if (tpot_s := ctx.time_per_output_token_s()) is not None:
        metrics.tpot_s.observe(tpot_s)
    if logger.isEnabledFor(logging.INFO):  # its arguments cost more than a filtered call
        logger.info(
            "request %s: %d prompt + %d output tokens in %.1f ms (first token at %.1f ms); "
            "prefill %s, decode %s",
            request_id,
            n_prompt,
            n_out,
            1000 * (ctx.answered_s - ctx.arrival_s),
            1000 * (t_first - ctx.arrival_s),
            ctx.prefill_url,
            " -> ".join(ctx.decode_urls) or "-",
        )
    if ctx.timeline is not None:
        ctx.timeline.end(200, num_output_tokens=n_out)
