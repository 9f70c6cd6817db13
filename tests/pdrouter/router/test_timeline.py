"""TimelineRing and Timeline: bounded, ordered, exact events under an injected clock."""

from __future__ import annotations

import pytest

from pdrouter.router.observability.timeline import TimelineRing


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def test_events_are_stamped_in_ms_since_accept() -> None:
    clock = FakeClock()
    ring = TimelineRing(4, clock)
    tl = ring.start("r1", arrival_s=50.0)
    clock.now_s = 50.0125
    tl.mark("prefill_sent", url="http://p")
    clock.now_s = 50.5
    tl.end(200, num_output_tokens=3)
    tl.end(502, error="late")  # ignored: the request already ended
    out = tl.to_json()
    assert out["request_id"] == "r1" and out["status"] == 200
    assert out["events"] == [
        {"event": "router_accept", "at_ms": 0.0},
        {"event": "prefill_sent", "at_ms": 12.5, "url": "http://p"},
        {"event": "end", "at_ms": 500.0, "status": 200, "num_output_tokens": 3},
    ]
    assert tl.has("prefill_sent") and not tl.has("decode_sent")
    assert (out["prefill"], out["decode"]) == (None, None)


def test_ring_keeps_the_newest_and_a_reused_id_is_the_newest() -> None:
    ring = TimelineRing(3, FakeClock())
    for i in range(5):
        ring.start(f"r{i}", 50.0)
    assert len(ring) == 3
    assert [ring.get(f"r{i}") is None for i in range(5)] == [True, True, False, False, False]
    again = ring.start("r2", 50.0)  # r2 moves to the newest place
    ring.start("r5", 50.0)
    assert ring.get("r3") is None and ring.get("r2") is again and len(ring) == 3


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeline capacity must be >= 1, got 0"):
        TimelineRing(0)
