"""A request's trace on the router: its context on the way, its spans from its timeline at the end.

    router.request                 SERVER  accept -> end      request id, status, tokens
    ├─ router.admission                    accept -> the first call (body, limits, queue,
    │                                        selection)
    ├─ router.prefetch             CLIENT  prefetch_sent -> prefetch_answered (D's reservation)
    │    └─ (D's prefetch span, parented by the traceparent the prefetch sent)
    ├─ router.prefill.attempt      CLIENT  prefill_sent -> prefill_done | prefill_failed
    │    └─ (P's spans, parented by the traceparent this attempt sent)
    ├─ router.decode.attempt       CLIENT  decode_sent -> decode_retry | decode_failover | end
    │    └─ (D's spans)
    └─ router.stream                       first_token_sent -> end (the stream's end)

Spans come from the timeline's own events (observability.timeline), so the two agree to the
clock reading. An attempt's span id is fixed by its name and number (pdrouter.common.tracing
.span_id): the hop's traceparent names it before the span is built.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from pdrouter.common.tracing import (
    TRACEPARENT,
    SpanRecord,
    SpanSink,
    TraceParent,
    TracingConfig,
    new_trace_id,
    parse_traceparent,
    sampled_at,
    span_id,
    span_sink,
)
from pdrouter.router.observability.timeline import Timeline


class TracedRequest(Protocol):
    """What the trace reads of a request (orchestrator.context.RequestContext)."""

    request_id: str
    endpoint: str
    model: str
    priority: int | None
    num_prompt_tokens: int
    num_output_tokens: int
    trace: RequestTrace | None
    timeline: Timeline | None

    @property
    def key_id(self) -> str | None: ...


log = logging.getLogger(__name__)
ROOT = "router.request"
PREFETCH = "router.prefetch"
# Where each kind of span ends: the first of these events after its start.
_ATTEMPT_ENDS = {
    "prefill": ("prefill_done", "prefill_failed"),
    "decode": ("decode_retry", "decode_failover", "end"),
}


class RequestTrace:
    """One request's trace context: the client's (honoured) or a new one."""

    __slots__ = ("client", "root")

    def __init__(self, traceparent: str | None, ratio: float = 1.0) -> None:
        self.client = parse_traceparent(traceparent)  # None: the trace starts here
        if self.client is not None:
            trace_id, sampled = self.client.trace_id, self.client.sampled
        else:
            trace_id = new_trace_id()
            sampled = ratio >= 1.0 or sampled_at(trace_id, ratio)
        self.root = TraceParent(trace_id, span_id(trace_id, ROOT), sampled)

    def hop_headers(self, headers: dict[str, str], role: str, attempt: int) -> dict[str, str]:
        """headers plus the traceparent of attempt number attempt of role's stage."""
        return self.call_headers(headers, attempt_span(role, attempt))

    def call_headers(self, headers: dict[str, str], span: str) -> dict[str, str]:
        """headers plus the traceparent of a call made under the router's span named span
        (the callee's spans are its children)."""
        return {**headers, TRACEPARENT: self.root.child(span).header()}


def attempt_span(role: str, attempt: int) -> str:
    """The name (and id seed) of a stage's attempt span."""
    return f"router.{role}.attempt#{attempt}"


def request_spans(timeline: Timeline, attributes: dict[str, Any]) -> list[SpanRecord]:
    """The router's spans of one ended request, from its timeline (see the module's tree)."""
    events = timeline.raw_events
    ns = timeline.unix_ns
    end_s = next(at for name, at, _ in reversed(events) if name == "end")
    start_s = events[0][1]
    spans = [SpanRecord(ROOT, None, ns(start_s), ns(end_s), attributes, "SERVER", _error(timeline))]
    first_call = next((at for name, at, _ in events if name.endswith("_sent")), end_s)
    spans.append(SpanRecord("router.admission", ROOT, ns(start_s), ns(first_call)))
    for i, (name, at_s, detail) in enumerate(events):
        later = events[i + 1 :]
        if name == "prefetch_sent":
            end = _first(later, ("prefetch_answered", "end"))
            answer = end[2] if end is not None else {}
            attrs = {
                "pd.worker": detail.get("url", ""),
                "pd.blocks_reserved": answer.get("blocks", 0),
            }
            spans.append(_span(PREFETCH, at_s, end, end_s, ns, attrs))
        elif name in ("prefill_sent", "decode_sent"):
            role = name.removesuffix("_sent")
            end = _first(later, _ATTEMPT_ENDS[role])
            attrs = {"pd.worker": detail.get("url", ""), "pd.attempt": detail.get("attempt", 0)}
            if end is not None and "error" in end[2]:  # a failed attempt names its error
                attrs["pd.error"] = str(end[2]["error"])
            span_name = attempt_span(role, detail.get("attempt", 0))
            spans.append(_span(span_name, at_s, end, end_s, ns, attrs))
        elif name == "first_token_sent":
            spans.append(SpanRecord("router.stream", ROOT, ns(at_s), ns(end_s)))
    return spans


def _first(
    events: list[tuple[str, float, dict[str, Any]]], names: tuple[str, ...]
) -> tuple[str, float, dict[str, Any]] | None:
    return next((event for event in events if event[0] in names), None)


def _span(name: str, start_s: float, end: Any, end_s: float, ns: Any, attrs: dict) -> SpanRecord:
    stop_s = end[1] if end is not None else end_s
    return SpanRecord(name, ROOT, ns(start_s), ns(stop_s), attrs, "CLIENT")


def _error(timeline: Timeline) -> str | None:
    status = timeline.status
    if status is None or status < 400:
        return None
    return f"HTTP {status}"


class RouterTracer:
    """Builds and exports the spans of each ended request (service: one per app)."""

    def __init__(self, sink: SpanSink) -> None:
        self.sink = sink

    def start(self, traceparent: str | None) -> RequestTrace:
        return RequestTrace(traceparent, self.sink.sample_ratio)

    def finish(self, ctx: TracedRequest) -> None:
        """Export the spans of ctx's request, which has ended (its timeline too)."""
        trace, timeline = ctx.trace, ctx.timeline
        if trace is None or timeline is None or timeline.status is None or not trace.root.sampled:
            return  # not sampled: the context travels on, no span is built
        client = trace.client
        remote_parent = client.span_id if client is not None else None
        try:  # a request's answer never depends on its trace
            spans = request_spans(timeline, request_attributes(ctx, timeline))
            self.sink.export(trace.root.trace_id, trace.root.sampled, remote_parent, spans)
        except Exception:
            log.exception("request %s: its trace was not exported", ctx.request_id)

    def shutdown(self) -> None:
        self.sink.shutdown()


def make_tracer(cfg: TracingConfig) -> RouterTracer | None:
    """The router's tracer, None when tracing is off (then nothing is traced at all)."""
    sink = span_sink(cfg, "pdrouter-router")
    return RouterTracer(sink) if sink is not None else None


def request_attributes(ctx: TracedRequest, timeline: Timeline) -> dict[str, Any]:
    """The root span's attributes: who, what, how it ended, where its prompt's KV came from."""
    attrs: dict[str, Any] = {
        "pd.request_id": ctx.request_id,
        "pd.endpoint": ctx.endpoint,
        "gen_ai.request.model": ctx.model,
        "http.response.status_code": timeline.status or 0,
        "pd.priority": ctx.priority or 0,
        "gen_ai.usage.input_tokens": ctx.num_prompt_tokens,
        "gen_ai.usage.output_tokens": ctx.num_output_tokens,
    }
    if ctx.key_id is not None:
        attrs["pd.api_key_id"] = ctx.key_id
    done = timeline.to_json()
    prefill, decode = done["prefill"], done["decode"]
    if prefill is not None:
        attrs["pd.prefill.worker"] = prefill["url"]
        for source, num in prefill["prompt_tokens"].items():  # the cache hits
            attrs[f"pd.prompt_tokens.{source}"] = num
        attrs["pd.handoff.bytes_written"] = prefill["num_bytes_written"]
    if decode is not None:
        attrs["pd.decode.worker"] = decode["url"]
        attrs["pd.handoff.blocks_loaded"] = decode["num_blocks_loaded"] or 0
        attrs["pd.handoff.bytes_read"] = decode["num_bytes_read"] or 0
    return attrs
