"""Per-request timelines for debugging: what happened to a recent request, and when.

    GET /debug/requests/{request_id}  ->
      {"request_id", "accepted_at_unix_s", "status", "events": [{"event", "at_ms", ...}],
       "prefill": P's own timings, "decode": D's own timings}

Events are stamped by the router in milliseconds since it accepted the request:
router_accept, prefill_sent, prefill_done, first_token_sent, decode_sent, first_decode_token,
and end (plus retry/failover events naming the instance; with early decode, prefetch_sent and
prefetch_answered, and D's count of blocks it loaded before the decode came). The work inside
P (queue + prefill, device-to-host copy, pool put) and inside D (block allocation wait, pool
get, host-to-device copy, its first token) comes from the timings P and D return, so one
request's handoff can be read off without scraping worker logs.

A bounded ring: the newest `capacity` requests are kept, the oldest dropped, so memory stays
fixed however long the router runs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pdrouter.wire.pd import DecodeEvent, DecodeTimings, PrefillResult, PrefillTimings


class Timeline:
    """One request's events; mark() appends, to_json() renders.

    A request is marked several times on the router's hot path, so marks keep raw clock
    readings and P's and D's timing models as they came; rounding and dumping wait for
    to_json(), which only a debugging reader calls.
    """

    def __init__(self, request_id: str, start_s: float, clock: Callable[[], float]) -> None:
        self.request_id = request_id
        self._start_s = start_s
        self._clock = clock
        self.accepted_at_unix_s = time.time() - (clock() - start_s)
        # (event, clock reading, detail)
        self._events: list[tuple[str, float, dict[str, Any]]] = [("router_accept", start_s, {})]
        # What the reader shows of P's and D's answers, not the answers themselves: a ring of
        # a thousand timelines would keep every answer's prompt ids and KV handle alive, and
        # the garbage collector would walk them all.
        self._prefill: tuple[str, PrefillTimings, int, int, int, tuple[int, ...]] | None = None
        self._decode: tuple[str, DecodeTimings | None, int, int, int, int] | None = None
        self.status: int | None = None  # set by end()
        # The priority P and D were sent (the body's, the header's or the key's default,
        # clamped to the key's max_priority: router.tenancy.gate); None until decided.
        self.priority: int | None = None

    def mark(self, event: str, **detail: Any) -> None:
        """Append event at the current time, with any JSON-able detail (instance url, ...)."""
        self._events.append((event, self._clock(), detail))

    def has(self, event: str) -> bool:
        """Whether event was marked (a reader's question: the request's path never asks)."""
        return any(name == event for name, _, _ in self._events)

    def record_prefill(self, url: str, result: PrefillResult) -> None:
        """P's answer arrived: mark it and keep P's own timings and pool counts."""
        self.mark("prefill_done", url=url)
        r = result
        tokens = (
            r.num_cached_tokens,
            r.num_host_cached_tokens,
            r.num_pool_cached_tokens,
            len(r.prompt_token_ids),
        )
        self._prefill = (
            url,
            r.timings,
            r.num_blocks_written,
            r.num_blocks_skipped,
            r.num_bytes_written,
            tokens,
        )

    def record_decode(self, url: str, ev: DecodeEvent) -> None:
        """D's final event: keep D's own timings and how it obtained the prompt KV."""
        self._decode = (
            url,
            ev.timings,
            ev.num_blocks_loaded,
            ev.num_tokens_recomputed,
            ev.num_bytes_read,
            ev.num_blocks_loaded_ahead,
        )

    def end(self, status: int, **detail: Any) -> None:
        """The final event. The request's one end (RouterService._end) calls it once; a
        second call would be ignored, so that the status recorded is the first."""
        if self.status is None:
            self.status = status
            self.mark("end", status=status, **detail)

    @property
    def raw_events(self) -> list[tuple[str, float, dict[str, Any]]]:
        """(event, clock reading, detail) as marked: what the request's trace is built from."""
        return self._events

    def unix_ns(self, at_s: float) -> int:
        """A clock reading of this timeline as Unix nanoseconds."""
        return int((self.accepted_at_unix_s + (at_s - self._start_s)) * 1e9)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The events so far: {"event", "at_ms" (since accept), **detail}."""
        return [
            {"event": event, "at_ms": round(1000.0 * (at_s - self._start_s), 3), **detail}
            for event, at_s, detail in self._events
        ]

    def _prefill_json(self) -> dict[str, Any] | None:
        if self._prefill is None:
            return None
        url, timings, written, skipped, num_bytes, (cached, host, pool, prompt) = self._prefill
        return {
            "url": url,
            **timings.model_dump(),
            "num_blocks_written": written,
            "num_blocks_skipped": skipped,
            "num_bytes_written": num_bytes,
            # the hit split: prompt tokens from P's device cache, host tier, the pool, computed
            "prompt_tokens": {
                "device": cached - pool - host,
                "host": host,
                "pool": pool,
                "computed": prompt - cached,
            },
        }

    def _decode_json(self) -> dict[str, Any] | None:
        if self._decode is None:
            return None
        url, timings, loaded, recomputed, num_bytes, ahead = self._decode
        return {
            "url": url,
            **(timings.model_dump() if timings is not None else {}),
            "num_blocks_loaded": loaded,
            "num_tokens_recomputed": recomputed,
            "num_bytes_read": num_bytes,
            "num_blocks_loaded_ahead": ahead,  # by the prefetch
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "accepted_at_unix_s": round(self.accepted_at_unix_s, 6),
            "status": self.status,
            "priority": self.priority,
            "events": self.events,
            "prefill": self._prefill_json(),
            "decode": self._decode_json(),
        }


class TimelineRing:
    """The timelines of the newest `capacity` requests, by request id."""

    def __init__(self, capacity: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"timeline capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._clock = clock
        self._id_to_timeline: OrderedDict[str, Timeline] = OrderedDict()

    def start(self, request_id: str, arrival_s: float) -> Timeline:
        """A new timeline for request_id (arrival_s on the ring's clock); evicts the oldest."""
        timeline = Timeline(request_id, arrival_s, self._clock)
        self._id_to_timeline.pop(request_id, None)  # a reused id: the newest request wins
        self._id_to_timeline[request_id] = timeline
        while len(self._id_to_timeline) > self.capacity:
            self._id_to_timeline.popitem(last=False)
        return timeline

    def get(self, request_id: str) -> Timeline | None:
        return self._id_to_timeline.get(request_id)

    def __len__(self) -> int:
        return len(self._id_to_timeline)
