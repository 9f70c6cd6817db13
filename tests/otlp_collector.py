"""A tiny OTLP/HTTP trace collector on a loopback port, for tests of the real export path.

Each POST /v1/traces body (protobuf ExportTraceServiceRequest, as the SDK's OTLP/HTTP exporter
sends it) is decoded into Span rows: service, name, ids, parent, kind, times, attributes.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int  # OTLP's: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                error = s.status.message if s.status.code == 2 else None
                attributes = {a.key: _value(a.value) for a in s.attributes}
                spans.append(Span(resource.get("service.name", ""), s.name, s.trace_id.hex(),
                                  s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                  s.start_time_unix_nano, s.end_time_unix_nano,
                                  attributes, error))  # fmt: skip
    return spans


class Collector:
    """Collects the spans every exporter pointed at url sends; stop() ends it."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode(body)
                with collector._lock:
                    collector.spans.extend(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
