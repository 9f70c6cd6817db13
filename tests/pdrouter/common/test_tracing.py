"""W3C trace context, span ids, where traces go and which are sampled (no SDK, no process but
one that recomputes a span id)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdrouter.common.tracing import (
    TraceParent,
    TracingConfig,
    parse_traceparent,
    sample_ratio,
    sampled_at,
    span_id,
    traces_endpoint,
)
from pdrouter.router.observability.trace import PREFETCH, RequestTrace

HEADER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traceparent_round_trips_and_its_flag_is_kept() -> None:
    parent = parse_traceparent(HEADER)
    assert parent == TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True)
    assert parent.header() == HEADER
    unsampled = parse_traceparent(HEADER[:-2] + "00")
    assert unsampled is not None and not unsampled.sampled
    assert parse_traceparent(" " + HEADER.upper() + " ") == parent  # case and spaces


@pytest.mark.parametrize(
    "value",
    [None, "", "garbage", "ff" + HEADER[2:], "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
     "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", HEADER + "-extra"],
)  # fmt: skip
def test_a_malformed_traceparent_is_ignored(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_span_ids_are_the_same_in_another_process() -> None:
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    here = span_id(trace_id, "router.prefill.attempt#1")
    code = ("from pdrouter.common.tracing import span_id; "
            f"print(span_id({trace_id}, 'router.prefill.attempt#1'))")  # fmt: skip
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123"}).stdout  # fmt: skip
    assert int(there) == here
    assert here != span_id(trace_id, "router.prefill.attempt#0")
    assert here != span_id(trace_id + 1, "router.prefill.attempt#1")


def test_the_endpoint_is_the_flag_else_the_otel_variables_else_off() -> None:
    flag = TracingConfig(otlp_endpoint="http://c:4318/")
    generic = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://g:4318"}
    assert traces_endpoint(flag, generic) == "http://c:4318/v1/traces"
    assert traces_endpoint(TracingConfig(), generic) == "http://g:4318/v1/traces"
    traces = {**generic, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}
    assert traces_endpoint(TracingConfig(), traces) == "http://t:1/x"
    assert traces_endpoint(TracingConfig(), {}) is None
    assert traces_endpoint(flag, {"OTEL_SDK_DISABLED": "TRUE"}) is None


def test_the_sampler_variables_set_the_share_of_new_traces() -> None:
    assert sample_ratio({}) == 1.0
    assert sample_ratio({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}) == 0.0
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert sample_ratio(ratio) == 0.25
    assert (sampled_at(2**62 - 1, 0.25), sampled_at(2**62, 0.25)) == (True, False)
    assert not RequestTrace(None, 0.0).root.sampled
    assert RequestTrace(None, 1.0).root.sampled
    assert RequestTrace(HEADER, 0.0).root.sampled  # the client's decision wins


def test_a_hop_carries_the_attempts_span_and_the_clients_flag() -> None:
    trace = RequestTrace(HEADER[:-2] + "00")
    headers = trace.hop_headers({"X-Request-Id": "r"}, "decode", 2)
    attempt = span_id(trace.root.trace_id, "router.decode.attempt#2")
    assert headers == {"X-Request-Id": "r",
                       "traceparent": f"00-{HEADER[3:35]}-{attempt:016x}-00"}  # fmt: skip


def test_the_prefetch_carries_the_routers_prefetch_span() -> None:
    """D's prefetch span is the child of the span the router exports as router.prefetch."""
    trace = RequestTrace(HEADER)
    headers = trace.call_headers({"X-Request-Id": "r"}, PREFETCH)
    prefetch = span_id(trace.root.trace_id, "router.prefetch")
    assert headers == {"X-Request-Id": "r",
                       "traceparent": f"00-{HEADER[3:35]}-{prefetch:016x}-01"}  # fmt: skip
