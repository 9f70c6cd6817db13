"""P's and D's spans of one request, built from the timings they already return.

    (router) router.prefill.attempt
      └─ pdworker.prefill              SERVER  the handler's span: P's total_s
           ├─ pdworker.prefix_lookup           pool exists() after the device match
           ├─ pdworker.prefix_load             pool get + host -> device of the hit
           ├─ pdworker.queue                   given to the engine -> first scheduled
           ├─ pdworker.compute                 first scheduled -> first token
           └─ pdworker.pool_write              what P waited for the write after its first
                                               token (all of it: d2h_s, put_s attributes)
    (router) router.prefetch
      └─ pdworker.prefetch             SERVER  arrival -> 202 (tokenized, the prompt's blocks
                                               reserved; P's writes then read as they land)
    (router) router.decode.attempt
      └─ pdworker.decode               SERVER  arrival -> the stream's end
           ├─ pdworker.kv_reservation          waiting for free blocks
           ├─ pdworker.pool_read               pool get + host -> device
           └─ pdworker.decode_steps            first output -> the stream's end

P's parts run back to back ending at its answer (the write overlaps the compute, so only its
wait is drawn); they are laid out from the end, since they are timed as durations. Nothing
here runs unless tracing is on (app.state.tracer is None otherwise).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pdrouter.common.tracing import (
    SpanRecord,
    SpanSink,
    TraceParent,
    TracingConfig,
    parse_traceparent,
    span_sink,
    unix_ns,
)
from pdrouter.wire.pd import PrefetchAnswer, PrefillResult

if TYPE_CHECKING:
    from workers.server.streaming import ClosingStreamingResponse


log = logging.getLogger(__name__)


class WorkerTracer:
    """Exports this worker's spans of each traced request (a traceparent came with it)."""

    def __init__(self, sink: SpanSink, url: str) -> None:
        self.sink = sink
        self.url = url

    def prefill(self, traceparent: str | None, result: PrefillResult) -> None:
        """P's spans of a prefill that answered now (never raises: an answer never depends
        on its trace)."""
        parent = parse_traceparent(traceparent)
        if parent is None or not parent.sampled:  # not traced, or not exported
            return
        try:
            self._prefill(parent, result)
        except Exception:
            log.exception("prefill %s: its spans were not exported", result.request_id)

    def _prefill(self, parent: TraceParent, result: PrefillResult) -> None:
        now_s, now_unix_s = time.monotonic(), time.time()
        t = result.timings
        root = f"pdworker.prefill#{parent.span_id:016x}"
        num_prompt = len(result.prompt_token_ids)
        attrs = {
            **self._who(result.request_id),
            "gen_ai.usage.input_tokens": num_prompt,
            "pd.prompt_tokens.device": result.num_cached_tokens
            - result.num_pool_cached_tokens
            - result.num_host_cached_tokens,
            "pd.prompt_tokens.host": result.num_host_cached_tokens,
            "pd.prompt_tokens.pool": result.num_pool_cached_tokens,
            "pd.prompt_tokens.computed": num_prompt - result.num_cached_tokens,
            "pd.handoff.blocks_written": result.num_blocks_written,
            "pd.handoff.blocks_skipped": result.num_blocks_skipped,
            "pd.handoff.bytes_written": result.num_bytes_written,
        }
        parts = [  # back to back, the last ending now
            ("pdworker.prefix_lookup", t.pool_lookup_s, {}),
            ("pdworker.prefix_load", t.pool_load_s, {}),
            ("pdworker.queue", t.engine_queue_s, {}),
            ("pdworker.compute", t.engine_compute_s, {}),
            ("pdworker.pool_write", t.write_wait_s, {"pd.d2h_s": t.d2h_s, "pd.put_s": t.put_s}),
        ]
        spans = [_at(root, None, now_s - t.total_s, now_s, now_s, now_unix_s, attrs, "SERVER")]
        end_s = now_s
        for name, duration_s, part_attrs in reversed(parts):
            spans.append(
                _at(
                    f"{name}#{parent.span_id:016x}",
                    root,
                    end_s - duration_s,
                    end_s,
                    now_s,
                    now_unix_s,
                    part_attrs,
                )
            )
            end_s -= duration_s
        self.sink.export(parent.trace_id, parent.sampled, parent.span_id, spans)

    def prefetch(self, traceparent: str | None, start_s: float, answer: PrefetchAnswer) -> None:
        """D's span of a prefetch it accepted now (start_s: its arrival): tokenizing and
        reserving the prompt's blocks, under the router's prefetch span (never raises)."""
        parent = parse_traceparent(traceparent)
        if parent is None or not parent.sampled:  # not traced, or not exported
            return
        try:
            now_s, now_unix_s = time.monotonic(), time.time()
            attrs = {
                **self._who(answer.request_id),
                "gen_ai.usage.input_tokens": answer.num_prompt_tokens,
                "pd.blocks_reserved": answer.num_blocks_reserved,
            }
            span = _at(
                f"pdworker.prefetch#{parent.span_id:016x}",
                None,
                start_s,
                now_s,
                now_s,
                now_unix_s,
                attrs,
                "SERVER",
            )
            self.sink.export(parent.trace_id, parent.sampled, parent.span_id, [span])
        except Exception:
            log.exception("prefetch %s: its span was not exported", answer.request_id)

    def decode_on_close(self, traceparent: str | None, response: ClosingStreamingResponse) -> None:
        """D's spans, exported when the response's stream closes."""
        parent = parse_traceparent(traceparent)
        if parent is None or not parent.sampled:  # not traced, or not exported
            return
        stream = response.body_iterator  # a workers.decode.stream.DecodeStream

        def export() -> None:
            try:
                self._decode(parent.trace_id, parent.sampled, parent.span_id, stream)
            except Exception:
                log.exception("decode: its spans were not exported")

        response.also_on_close(export)

    def _decode(self, trace_id: int, sampled: bool, parent_id: int, stream: Any) -> None:
        """stream: the DecodeStream (its timing, loaded and req), now closed."""
        now_s, now_unix_s = time.monotonic(), time.time()
        timing, loaded, req = stream.timing, stream.loaded, stream.req
        suffix = f"#{parent_id:016x}"
        root = "pdworker.decode" + suffix
        attrs = {
            **self._who(req.request_id),
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            "pd.handoff.blocks_loaded": loaded.num_loaded,
            "pd.handoff.bytes_read": loaded.num_bytes,
            "pd.tokens_recomputed": len(req.prompt_token_ids) - req.num_computed_tokens,
        }
        read_s = loaded.timings.get_s + loaded.timings.h2d_s
        reserved_s = timing.start_s + timing.alloc_wait_s
        clock = (now_s, now_unix_s)
        spans = [
            _at(root, None, timing.start_s, now_s, *clock, attrs, "SERVER"),
            _at("pdworker.kv_reservation" + suffix, root, timing.start_s, reserved_s, *clock),
            _at(
                "pdworker.pool_read" + suffix,
                root,
                reserved_s,
                reserved_s + read_s,
                *clock,
                {"pd.get_s": loaded.timings.get_s, "pd.h2d_s": loaded.timings.h2d_s},
            ),
            _at("pdworker.decode_steps" + suffix, root, timing.first_s, now_s, *clock),
        ]
        self.sink.export(trace_id, sampled, parent_id, spans)

    def _who(self, request_id: str) -> dict[str, Any]:
        return {"pd.request_id": request_id, "pd.worker": self.url}


def _at(
    name: str,
    parent: str | None,
    start_s: float,
    end_s: float,
    now_s: float,
    now_unix_s: float,
    attrs: dict[str, Any] | None = None,
    kind: str = "INTERNAL",
) -> SpanRecord:
    """A span between two time.monotonic() readings."""
    return SpanRecord(
        name,
        parent,
        unix_ns(start_s, now_s, now_unix_s),
        unix_ns(end_s, now_s, now_unix_s),
        attrs or {},
        kind,
    )


def make_worker_tracer(cfg: TracingConfig, role: str, url: str) -> WorkerTracer | None:
    """This worker's tracer, None when tracing is off (the default)."""
    sink = span_sink(cfg, f"pdworker-{role}")
    return WorkerTracer(sink, url) if sink is not None else None
