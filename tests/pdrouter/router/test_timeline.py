"""TimelineRing and Timeline: bounded, ordered, exact events under an injected clock."""

from __future__ import annotations

import weakref

import pytest

from pdrouter.router.observability.timeline import TimelineRing
from pdrouter.wire.pd import DecodeEvent, KVHandle, PrefillResult, PrefillTimings


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


def test_the_answers_are_read_not_kept() -> None:
    """P's and D's answers outlive their request only as the numbers the reader shows: the
    ring keeps a thousand timelines, and each answer kept would keep its prompt ids and KV
    handle for the collector to walk."""
    tl = TimelineRing(4, FakeClock()).start("r1", arrival_s=50.0)
    result = PrefillResult(
        request_id="r1", prompt_token_ids=[1, 2, 3, 4], first_token_id=9, first_text="",
        kv=KVHandle(fingerprint="fp", block_size=2, num_tokens=4, keys=["k0", "k1"]),
        num_blocks_written=2, num_cached_tokens=3, num_pool_cached_tokens=2,
        num_host_cached_tokens=1, timings=PrefillTimings(put_s=0.25),
    )  # fmt: skip
    final = DecodeEvent(token_ids=[5], text="x", finished=True, finish_reason="length",
                        num_output_tokens=2,
                        num_blocks_loaded=2, num_bytes_read=64)  # fmt: skip
    tl.record_prefill("http://p", result)
    tl.record_decode("http://d", final)
    answers = [weakref.ref(result), weakref.ref(final)]
    del result, final
    assert [ref() for ref in answers] == [None, None]
    out = tl.to_json()
    assert out["prefill"] == {
        "url": "http://p", **PrefillTimings(put_s=0.25).model_dump(),
        "num_blocks_written": 2, "num_blocks_skipped": 0, "num_bytes_written": 0,
        "prompt_tokens": {"device": 0, "host": 1, "pool": 2, "computed": 1},
    }  # fmt: skip
    assert out["decode"] == {
        "url": "http://d", "num_blocks_loaded": 2, "num_tokens_recomputed": None,
        "num_bytes_read": 64, "num_blocks_loaded_ahead": None,
    }  # fmt: skip
