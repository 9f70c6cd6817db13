"""instances.cache_events.follow against a scripted worker (the faults a real one rarely
shows on demand): snapshot first, then events; a new epoch reloads the snapshot; 404 (cache
off) forgets the view; a 500 or a body that is no CacheEvents changes nothing."""

from __future__ import annotations

import asyncio

import httpx

from pdrouter.router.instances.cache_events import follow
from pdrouter.router.instances.cache_index import CacheIndex
from pdrouter.router.instances.instance import Instance
from pdrouter.wire.cache_events import (
    CACHE_EVENTS_PATH,
    CACHE_SNAPSHOT_PATH,
    CacheEvent,
    CacheEvents,
    CacheSnapshot,
)

P = Instance("http://p1", "prefill", healthy=True)


class Worker:
    """Answers the two doors from its current state; counts the calls by path."""

    def __init__(self) -> None:
        self.epoch, self.held, self.events = "e1", ["a"], [CacheEvent(seq=0, kind="stored",
                                                                      hashes=["b"])]  # fmt: skip
        self.status = 200
        self.calls: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.path)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "x", "type": "x"}})
        if request.url.path == CACHE_SNAPSHOT_PATH:
            snap = CacheSnapshot(epoch=self.epoch, next_seq=0, tiers={"device": self.held},
                                 anchors=[])  # fmt: skip
            return httpx.Response(200, content=snap.model_dump_json())
        assert request.url.path == CACHE_EVENTS_PATH
        since = int(request.url.params["since"])
        answer = CacheEvents(epoch=self.epoch, next_seq=len(self.events), gap=False,
                             events=[e for e in self.events if e.seq >= since])  # fmt: skip
        return httpx.Response(200, content=answer.model_dump_json())


def _follow(index: CacheIndex, worker: Worker) -> None:
    async def once() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker.handle)) as client:
            await follow(index, client, P)

    asyncio.run(once())


def test_snapshot_then_events_then_a_restart_reloads() -> None:
    index, worker = CacheIndex(), Worker()
    _follow(index, worker)
    assert worker.calls == [CACHE_SNAPSHOT_PATH] and index.held(P.url, "device") == {"a"}
    _follow(index, worker)
    assert worker.calls[1:] == [CACHE_EVENTS_PATH]
    assert index.held(P.url, "device") == {"a", "b"} and index.position(P.url) == ("e1", 1)
    worker.epoch, worker.held, worker.events = "e2", ["z"], []  # restarted
    _follow(index, worker)
    assert worker.calls[2:] == [CACHE_EVENTS_PATH, CACHE_SNAPSHOT_PATH]
    assert index.held(P.url, "device") == {"z"} and index.position(P.url) == ("e2", 0)


def test_faults_change_nothing_and_cache_off_forgets() -> None:
    index, worker = CacheIndex(), Worker()
    _follow(index, worker)
    worker.status = 500
    _follow(index, worker)
    assert index.position(P.url) == ("e1", 0) and index.held(P.url, "device") == {"a"}
    worker.status = 200
    worker.handle = lambda request: httpx.Response(200, content=b'{"epoch": 1}')  # type: ignore[method-assign]
    _follow(index, worker)
    assert index.position(P.url) == ("e1", 0)
    worker.handle = lambda request: httpx.Response(404, json={})  # type: ignore[method-assign]
    _follow(index, worker)
    assert index.position(P.url) is None
