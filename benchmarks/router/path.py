"""Where the router's own time goes: one streamed request at a time through the real app,
in-process, against a scripted upstream (no sockets, no other process; each call waits one
turn of the event loop, where a real one waits for the worker).

    python -m benchmarks.router.path [--requests 2000] [--events-per-read 8] [--default-gc]

The app is `create_app` as `pdrouter serve` builds it (validation, ids, admission, selection,
breakers, call guards, metrics, timelines, the disconnect watch); only its Upstream is
replaced by one that answers P's PrefillResult and D's 31 DecodeEvents, in reads of
--events-per-read events. What is left is the router's own CPU on a warm path: the total per
request (the median's wall clock, and the process's CPU time per request), and per segment
of the request's timeline (router accept -> prefill sent -> ... -> end). On the router
benchmark's one-request-at-a-time phase the same work runs with cold caches and costs 3-5x
more; this shows which parts there are and how they compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry
from pdrouter.router.serve import settle_collector
from pdrouter.router.upstream.contract import HopTimeout, UpstreamResponse
from pdrouter.wire.pd import DecodeEvent, KVHandle, PrefillResult, decode_event_sse

NUM_TOKENS = 32
_BODY = (b'{"model": "mock", "prompt": "Say something.", "max_tokens": %d, "temperature": 0, '
         b'"stream": true}' % NUM_TOKENS)  # fmt: skip


class _Answer:
    def __init__(self, content: bytes, reads: list[bytes]) -> None:
        self.status_code = 200
        self.headers: Mapping[str, str] = {}
        self.content = content
        self.text = content.decode()
        self._reads = reads

    body_complete = True

    async def read(self) -> bytes:
        return self.content

    async def chunks(self) -> AsyncIterator[bytes]:
        for data in self._reads:
            yield data


class ScriptedUpstream:
    """P's result and D's events, answered after one turn of the event loop."""

    name = "scripted"

    def __init__(self, events_per_read: int) -> None:
        self.prefill = PrefillResult(
            request_id="r", prompt_token_ids=[1, 2, 3], first_token_id=1000, first_text=" w0",
            kv=KVHandle(fingerprint="fp", block_size=16, num_tokens=3, keys=["k0"]),
        ).model_dump_json().encode()  # fmt: skip
        last = NUM_TOKENS - 1
        events = [  # as D writes them (decode_event_sse)
            decode_event_sse(DecodeEvent(
                token_ids=[1000 + k], text=f" w{k}", num_output_tokens=k + 1,
                finished=k == last, finish_reason="length" if k == last else None,
            ))
            for k in range(1, NUM_TOKENS)
        ]  # fmt: skip
        self.reads = [b"".join(events[i : i + events_per_read])
                      for i in range(0, len(events), events_per_read)]  # fmt: skip

    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, content: bytes | None,
                      headers: Mapping[str, str], timeout: HopTimeout,
                      ) -> AsyncIterator[UpstreamResponse]:  # fmt: skip
        # One turn of the event loop, where a real call waits for the worker: what the
        # router does meanwhile (the disconnect watch's start, the answer's frame) is timed.
        await asyncio.sleep(0)
        if url.endswith("/internal/prefill"):
            yield _Answer(self.prefill, [])
        else:
            yield _Answer(b"", self.reads)

    async def aclose(self) -> None:
        pass


class _Client:
    """One ASGI client: the body at once, then `http.disconnect` once the answer is complete,
    as uvicorn delivers it (the router's disconnect watch ends there)."""

    def __init__(self) -> None:
        self.delivered = False
        self.answered = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": _BODY, "more_body": False}
        await self.answered.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.answered.set()


async def measure(
    num_requests: int, events_per_read: int, serving_gc: bool = True
) -> tuple[float, float, dict[str, float]]:
    """(median us per request, the process's CPU us per request, median us per timeline
    segment) over num_requests. On a shared machine the CPU moves less than the median: a
    preempted request's wait is not in it. serving_gc: the garbage collector set as `pdrouter
    serve` sets it (False: CPython's defaults)."""
    registry = Registry(["http://p:1"], ["http://d:1"])
    for inst in registry.all():
        inst.healthy = True
    app = create_app(RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",)),
                     registry)  # fmt: skip
    service: Any = app.service
    if serving_gc:
        settle_collector()
    await service.start(ScriptedUpstream(events_per_read))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    totals_s: list[float] = []
    segments_ms: defaultdict[str, list[float]] = defaultdict(list)
    cpu_s = 0.0
    try:
        for i in range(num_requests + 200):  # the first 200 warm the path
            if i == 200:
                cpu_s = -time.process_time()
            client = _Client()
            t0 = time.perf_counter()
            await app(scope, client.receive, client.send)
            elapsed_s = time.perf_counter() - t0
            assert client.sent[-1]["body"].endswith(b"data: [DONE]\n\n"), client.sent[-1]
            if i < 200:
                continue
            totals_s.append(elapsed_s)
            request_id = dict(client.sent[0]["headers"])[b"x-request-id"].decode()
            timeline = service.timelines.get(request_id)
            assert timeline is not None, request_id
            for before, after in itertools.pairwise(timeline.events):
                key = f"{before['event']} -> {after['event']}"
                segments_ms[key].append(after["at_ms"] - before["at_ms"])
        cpu_s += time.process_time()
    finally:
        await service.stop()
    segments_us = {k: 1000 * statistics.median(v) for k, v in segments_ms.items()}
    return 1e6 * statistics.median(totals_s), 1e6 * cpu_s / num_requests, segments_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router.path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--events-per-read", type=int, default=8)
    parser.add_argument("--default-gc", action="store_true",
                        help="CPython's collector settings, not the router's")  # fmt: skip
    args = parser.parse_args(argv)
    import uvloop

    total_us, cpu_us, segments_us = uvloop.run(
        measure(args.requests, args.events_per_read, not args.default_gc)
    )
    print(f"one streamed {NUM_TOKENS}-token request through the router in-process, "
          f"{args.events_per_read} events per read: median {total_us:.0f} us, "
          f"CPU {cpu_us:.0f} us per request")  # fmt: skip
    for key, us in segments_us.items():
        print(f"  {key:<42} {us:6.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
