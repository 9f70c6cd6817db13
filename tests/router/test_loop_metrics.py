"""LoopHistogram (the router's lock-free histogram) exposes exactly what prometheus_client's
Histogram exposes for the same observations: bounds included, +Inf, sum and count."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdrouter.metrics import LoopHistogram

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
