"""The router's lock-free metrics (LoopHistogram, LoopCounter, LoopGauge) expose exactly what
prometheus_client's Histogram, Counter and Gauge expose for the same updates (bounds, +Inf,
sum and count; labels; the `_total` suffix), except the optional `_created` samples."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdrouter.router.observability.metrics import LoopCounter, LoopGauge, LoopHistogram

BUCKETS = (0.001, 0.0025, 0.01, 0.5, 1.0)
VALUES = [0.0, 0.0005, 0.001, 0.0010001, 0.0025, 0.3, 1.0, 7.5, 120.0, 0.01]


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line and "_created" not in line)


def test_same_exposition_as_prometheus_client() -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("lat_seconds", "a latency", BUCKETS, ours_reg)
    theirs = Histogram("lat_seconds", "a latency", buckets=BUCKETS, registry=theirs_reg)
    assert _samples(ours_reg) == _samples(theirs_reg)  # empty
    for value in VALUES:
        ours.observe(value)
        theirs.observe(value)
    assert _samples(ours_reg) == _samples(theirs_reg)
    assert 'lat_seconds_bucket{le="0.001"} 3.0' in _samples(ours_reg)  # a bound is inclusive
    assert "lat_seconds_count 10.0" in _samples(ours_reg)


def test_observe_many_is_that_many_observations() -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("gap_seconds", "a gap", BUCKETS, ours_reg)
    theirs = LoopHistogram("gap_seconds", "a gap", BUCKETS, theirs_reg)
    ours.observe_many(0.0, 5)
    ours.observe_many(0.3, 2)
    for value in [0.0] * 5 + [0.3] * 2:
        theirs.observe(value)
    assert _samples(ours_reg) == _samples(theirs_reg)
    assert "gap_seconds_count 7.0" in _samples(ours_reg)


def test_counters_expose_as_prometheus_client_does() -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours_plain = LoopCounter("tokens", "tokens sent", ours_reg)
    theirs_plain = Counter("tokens", "tokens sent", registry=theirs_reg)
    ours = LoopCounter("requests", "requests by status", ours_reg, ("endpoint", "status"))
    theirs = Counter("requests", "requests by status", ["endpoint", "status"], registry=theirs_reg)
    assert _samples(ours_reg) == _samples(theirs_reg)  # a labeled counter shows no sample yet
    for endpoint, status in [("chat", "200"), ("chat", "200"), ("completions", "429")]:
        ours.labels(endpoint, status).inc()
        theirs.labels(endpoint, status).inc()
    ours_plain.inc(3)
    theirs_plain.inc(3)
    ours.labels("chat", "499").inc(0)
    theirs.labels("chat", "499").inc(0)
    assert _samples(ours_reg) == _samples(theirs_reg)
    assert 'requests_total{endpoint="chat",status="200"} 2.0' in _samples(ours_reg)
    assert "tokens_total 3.0" in _samples(ours_reg)


def test_counter_refuses_to_go_down_and_wrong_label_counts() -> None:
    counter = LoopCounter("requests", "requests", CollectorRegistry(), ("endpoint",))
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("chat").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("chat", "200")
    assert counter.labels("chat").value == 0


def test_gauge_exposes_as_prometheus_client_does() -> None:
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopGauge("in_progress", "requests being served", ours_reg)
    theirs = Gauge("in_progress", "requests being served", registry=theirs_reg)
    for op in ("inc", "inc", "dec", "inc"):
        getattr(ours, op)()
        getattr(theirs, op)()
    assert _samples(ours_reg) == _samples(theirs_reg)
    assert "in_progress 2.0" in _samples(ours_reg)
