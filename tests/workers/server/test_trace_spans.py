"""P's and D's spans as the workers build them from their timings: P's engine queue and
compute as spans of their own, laid back to back ending at the answer; D's prefetch under the
router's prefetch span. The sink records what it is given (the OTLP path itself runs across
real processes in tests/e2e/ops/test_operate.py)."""

from __future__ import annotations

import time
from typing import Any

from pdrouter.common.tracing import SpanRecord, TraceParent
from pdrouter.wire.pd import KVHandle, PrefetchAnswer, PrefillResult, PrefillTimings
from workers.server.trace_spans import WorkerTracer

TRACE = TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
URL = "http://w:1"


class _Sink:
    def __init__(self) -> None:
        self.exported: list[tuple[int, bool, int | None, list[SpanRecord]]] = []

    def export(self, trace_id: int, sampled: bool, parent: int | None, spans: Any) -> None:
        self.exported.append((trace_id, sampled, parent, list(spans)))


def _tracer() -> tuple[WorkerTracer, _Sink]:
    sink = _Sink()
    return WorkerTracer(sink, URL), sink  # type: ignore[arg-type]


def test_ps_queue_and_compute_are_spans_of_their_own() -> None:
    tracer, sink = _tracer()
    timings = PrefillTimings(pool_lookup_s=0.001, pool_load_s=0.002, queue_compute_s=0.05,
                             engine_queue_s=0.03, engine_compute_s=0.015, write_wait_s=0.004,
                             total_s=0.06)  # fmt: skip
    result = PrefillResult(request_id="r1", prompt_token_ids=[1, 2, 3], first_token_id=7,
                           first_text="a", timings=timings,
                           kv=KVHandle(fingerprint="f", block_size=16, num_tokens=3,
                                       keys=["k"]))  # fmt: skip
    tracer.prefill(TRACE.header(), result)
    ((trace_id, sampled, parent, spans),) = sink.exported
    assert (trace_id, sampled, parent) == (TRACE.trace_id, True, TRACE.span_id)
    root = f"pdworker.prefill#{TRACE.span_id:016x}"
    names = [s.name.split("#")[0] for s in spans]
    parts = ["pool_write", "compute", "queue", "prefix_load", "prefix_lookup"]  # from the end
    assert names == ["pdworker.prefill", *(f"pdworker.{p}" for p in parts)]
    assert [s.parent for s in spans] == [None] + [root] * 5
    by_name = dict(zip(names, spans, strict=True))
    for name, seconds in (("pdworker.queue", 0.03), ("pdworker.compute", 0.015)):
        span = by_name[name]
        assert abs((span.end_ns - span.start_ns) - seconds * 1e9) < 1000, name
    # back to back: the queue ends where the compute starts, the compute where the write does
    assert by_name["pdworker.queue"].end_ns == by_name["pdworker.compute"].start_ns
    assert by_name["pdworker.compute"].end_ns == by_name["pdworker.pool_write"].start_ns


def test_ds_prefetch_is_a_span_under_the_routers_prefetch() -> None:
    tracer, sink = _tracer()
    answer = PrefetchAnswer(request_id="r2", num_prompt_tokens=40, num_blocks_reserved=3)
    start_s = time.monotonic() - 0.02
    tracer.prefetch(None, start_s, answer)  # no trace context: nothing
    tracer.prefetch(TraceParent(TRACE.trace_id, TRACE.span_id, False).header(), start_s, answer)
    assert sink.exported == []  # not sampled: nothing either
    tracer.prefetch(TRACE.header(), start_s, answer)
    ((trace_id, _, parent, (span,)),) = sink.exported
    assert (trace_id, parent) == (TRACE.trace_id, TRACE.span_id)
    assert (span.name, span.parent, span.kind) == (
        f"pdworker.prefetch#{TRACE.span_id:016x}", None, "SERVER")  # fmt: skip
    assert dict(span.attributes) == {"pd.request_id": "r2", "pd.worker": URL,
                                     "gen_ai.usage.input_tokens": 40,
                                     "pd.blocks_reserved": 3}  # fmt: skip
    assert span.end_ns - span.start_ns >= 20_000_000
