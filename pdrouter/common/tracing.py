"""OpenTelemetry traces, off unless asked for: W3C trace context and spans built after the fact.

    client ──traceparent──► router ──traceparent──► P   (P's spans: child of the attempt's)
                              │    ──traceparent──► D   (D's spans: child of the attempt's)
                              └─ at the request's end: its spans, from its timeline

Every server builds its spans once the work is over, from what it already measures (the
router's timeline, P's and D's timings), so the trace and the timeline cannot disagree and the
request path does no tracer work: with tracing off (the default) nothing here runs at all but
the check that a sink is None. A span's id is a pure function of the trace id and its name
(span_id), so the router can send an attempt's id in the traceparent before it builds the
span that carries it.

On with `--otlp-endpoint URL` (router and workers) or the standard OTEL_EXPORTER_OTLP_ENDPOINT
/ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT variables; OTEL_SDK_DISABLED=true turns it off again.
The SDK reads the others itself (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*,
OTEL_EXPORTER_OTLP_HEADERS, ...). Spans leave through the SDK's BatchSpanProcessor and its
OTLP/HTTP (protobuf) exporter. A client's traceparent whose sampled flag is off is carried on
but nothing is exported for it.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdrouter.common.flags import flag

TRACEPARENT = "traceparent"
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ids = random.Random()  # ids need to be unique, not unpredictable: no system call per id


@dataclass(frozen=True)
class TracingConfig:
    otlp_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "--otlp-endpoint",
            "export OpenTelemetry traces over OTLP/HTTP to this collector, e.g. "
            "http://127.0.0.1:4318 (none: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else off)",
            metavar="URL",
        ),
    )


@dataclass(frozen=True)
class TraceParent:
    """A W3C trace context: the trace, the caller's span, whether the trace is sampled."""

    trace_id: int
    span_id: int
    sampled: bool = True

    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    def child(self, name: str) -> TraceParent:
        """The context a callee gets under the span this trace calls name (span_id)."""
        return TraceParent(self.trace_id, span_id(self.trace_id, name), self.sampled)


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The context of a traceparent header, None when absent or malformed (then a new trace
    starts, as the W3C recommendation says: a bad header is ignored, never an error)."""
    if not value:
        return None
    found = _TRACEPARENT_RE.match(value.strip().lower())
    if found is None or found.group(1) == "ff":
        return None
    trace_id, parent_id = int(found.group(2), 16), int(found.group(3), 16)
    if trace_id == 0 or parent_id == 0:
        return None
    return TraceParent(trace_id, parent_id, bool(int(found.group(4), 16) & 1))


def new_trace_id() -> int:
    return _ids.getrandbits(128) or 1


def span_id(trace_id: int, name: str) -> int:
    """The id of the span called name in trace_id: the same on every call, so a caller can
    hand it on (a traceparent) before the span exists."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, key=trace_id.to_bytes(16, "big"))
    return int.from_bytes(digest.digest(), "big") or 1


def unix_ns(monotonic_s: float, now_monotonic_s: float, now_unix_s: float) -> int:
    """A time.monotonic() reading as Unix nanoseconds, given one pair of readings of both."""
    return int((now_unix_s - (now_monotonic_s - monotonic_s)) * 1e9)


@dataclass(frozen=True)
class SpanRecord:
    """A finished span: name (also its id's seed, span_id), its parent's name (None: the
    trace's remote parent), Unix nanoseconds, attributes, and kind (SpanKind's name)."""

    name: str
    parent: str | None
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "INTERNAL"
    error: str | None = None  # the status description of a span that failed


class SpanSink:
    """Hands finished spans to the SDK's batch processor and its OTLP/HTTP exporter."""

    def __init__(self, service_name: str, endpoint: str | None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:  # pragma: no cover - the message is the point
            raise RuntimeError(
                "tracing needs the OpenTelemetry SDK: pip install 'pdrouter[otel]' "
                "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
            ) from exc
        self.resource = Resource.create({"service.name": service_name})
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        self.sample_ratio = 1.0  # of the traces started here (sample_ratio)
        atexit.register(self.processor.shutdown)  # what is queued leaves before the exit

    def export(
        self, trace_id: int, sampled: bool, remote_parent: int | None, spans: Sequence[SpanRecord]
    ) -> None:
        """Queue spans of trace_id for export (none when not sampled); a span without a
        parent record is the child of remote_parent, the caller's span in another process
        (None: a root)."""
        if not sampled:
            return
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        remote = None
        if remote_parent is not None:
            remote = SpanContext(trace_id, remote_parent, True, flags)
        for record in spans:
            context = SpanContext(trace_id, span_id(trace_id, record.name), False, flags)
            parent_context = remote
            if record.parent is not None:
                parent_context = SpanContext(
                    trace_id, span_id(trace_id, record.parent), False, flags
                )
            status = Status(StatusCode.UNSET)
            if record.error is not None:
                status = Status(StatusCode.ERROR, record.error)
            span = ReadableSpan(
                record.name.split("#")[0],  # "#n" tells attempts apart in the id's seed only
                context=context,
                parent=parent_context,
                resource=self.resource,
                attributes=dict(record.attributes),
                kind=SpanKind[record.kind],
                status=status,
                start_time=record.start_ns,
                end_time=record.end_ns,
            )
            self.processor.on_end(span)

    def shutdown(self) -> None:
        """Export what is queued, then stop."""
        self.processor.shutdown()


def traces_endpoint(cfg: TracingConfig, environ: Mapping[str, str]) -> str | None:
    """Where traces go: --otlp-endpoint, else the OTEL_* variables; None: tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if cfg.otlp_endpoint:
        return _with_traces_path(cfg.otlp_endpoint)
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _with_traces_path(environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return None


def _with_traces_path(base: str) -> str:
    """OTLP/HTTP's traces path under a base URL (as the SDK does for the generic variable)."""
    return base.rstrip("/") + "/v1/traces"


def span_sink(
    cfg: TracingConfig, service_name: str, environ: Mapping[str, str] | None = None
) -> SpanSink | None:
    """The sink of this server's spans, None when tracing is off (the default)."""
    env = os.environ if environ is None else environ
    endpoint = traces_endpoint(cfg, env)
    if endpoint is None:
        return None
    sink = SpanSink(env.get("OTEL_SERVICE_NAME") or service_name, endpoint)
    sink.sample_ratio = sample_ratio(env)
    return sink


def sample_ratio(environ: Mapping[str, str]) -> float:
    """The share of the traces started here (no client's context) that are exported, from
    OTEL_TRACES_SAMPLER (default parentbased_always_on: all; *always_off: none;
    *traceidratio: OTEL_TRACES_SAMPLER_ARG). A client's context keeps its own sampled flag."""
    sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler.endswith("always_off"):
        return 0.0
    if sampler.endswith("traceidratio"):
        try:
            return min(max(float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1")), 0.0), 1.0)
        except ValueError:
            return 1.0
    return 1.0


def sampled_at(trace_id: int, ratio: float) -> bool:
    """Whether a new trace is sampled at ratio: by its id's low 64 bits, as the SDK's
    TraceIdRatioBased sampler decides, so every server decides the same."""
    return (trace_id & 0xFFFFFFFFFFFFFFFF) < ratio * 2**64
