"""Routing that knows where the blocks are, end to end: 2 P + 2 D + router with
`--prefill-policy cache_aware`, real worker processes and pool.

Beside the cluster's router, the test runs two more router replicas' indexes in process
(CacheAware objects following the same Ps with pdrouter.router.instances.cache_events, the
router's own code): after a request, the P that served it holds the prompt's blocks in both
replicas' indexes, both pick that P for the next question on the same system prompt, and the
cluster's router sends it there too (a device hit, not a pool read). A P restarted by the
launcher has a new epoch: the replicas rebuild its view from its snapshot (empty), and a
question sent meanwhile is still answered exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.common.auth import internal_headers
from pdrouter.launch.cluster import Cluster
from pdrouter.router.instances.cache_events import follow_all
from pdrouter.router.instances.instance import Instance
from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.cache_aware import CacheAware
from pdrouter.wire.cache_events import CACHE_EVENTS_PATH
from pdrouter.wire.prompt_keys import body_prompt_keys
from tests.e2e.cache.conftest import BLOCK_SIZE, MODEL, by_source, cache_spec, delta
from tests.e2e.cluster_fixture import started_cluster
from tests.wait import wait_until

pytestmark = pytest.mark.slow
SYSTEM = "You are a careful assistant. Answer briefly and exactly. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    spec = cache_spec(tmp_path_factory.mktemp("route-logs"), tiny_cache_dir)
    spec = dataclasses.replace(
        spec, router_args=(*spec.router_args, "--prefill-policy=cache_aware")
    )
    yield from started_cluster(spec)


def _body(question: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}


class Replica:
    """A router replica's prefill policy and index, following the cluster's Ps."""

    def __init__(self, c: Cluster) -> None:
        self.policy = CacheAware()
        self.registry = Registry(c.prefill_urls, c.decode_urls)
        for inst in self.registry.prefill:
            inst.healthy, inst.block_size = True, BLOCK_SIZE
        self.headers = internal_headers(c.internal_secret)

    def sync(self) -> None:
        """One round of the router's event reading."""

        async def once() -> None:
            async with httpx.AsyncClient(headers=self.headers) as client:
                await follow_all(self.policy.index, client, self.registry)

        asyncio.run(once())

    def pick(self, body: dict) -> Instance:
        return self.policy.pick_for(self.registry.prefill, json.dumps(body).encode())

    def hit(self, url: str, body: dict) -> int:
        return self.policy.index.hit_blocks(url, body_prompt_keys(json.dumps(body).encode()))


def _router_view(c: Cluster, url: str) -> dict | None:
    headers = {"Authorization": f"Bearer {c.admin_key}"}
    listing = httpx.get(f"{c.router_url}/instances", headers=headers, timeout=10).json()
    return next(i.get("cache") for i in listing["instances"] if i["url"] == url)


def _ask(c: Cluster, body: dict) -> str:
    resp = httpx.post(f"{c.router_url}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def test_the_index_follows_the_blocks_and_replicas_agree(cluster: Cluster) -> None:
    a, b = Replica(cluster), Replica(cluster)
    for r in (a, b):
        r.sync()
    _ask(cluster, _body("What is a block?"))

    def holders() -> list[str]:
        a.sync()
        return [u for u in cluster.prefill_urls if a.hit(u, _body("Another question?")) > 0]

    (p_url,) = wait_until(holders, 30.0, "an index that places the system prompt on one P")
    num_system_blocks = a.hit(p_url, _body("Another question?"))
    held = a.policy.index.held(p_url, "device")
    assert num_system_blocks >= len(SYSTEM) // 4 // BLOCK_SIZE and len(held) >= num_system_blocks
    assert a.pick(_body("Another question?")).url == p_url
    b.sync()
    assert b.policy.index.held(p_url, "device") == held
    assert b.pick(_body("Another question?")).url == p_url
    # The cluster's router read the same events: its view of p_url (on /instances) is b's.
    view = b.policy.index.describe(p_url)["cache"]
    wait_until(lambda: _router_view(cluster, p_url), 10.0, "the router's view", done=view.__eq__)
    before = by_source(cluster.router_url)
    _ask(cluster, _body("Another question?"))
    # The router counts a request's prompt tokens as it ends it, after the answer's last byte.
    moved = wait_until(
        lambda: delta(by_source(cluster.router_url), before),
        10.0,
        "the request's prompt tokens counted",
        done=lambda d: sum(d.values()) > 0,
    )
    # The cluster's router chose p_url too: the system prompt's blocks were device hits.
    assert moved["device"] >= num_system_blocks * BLOCK_SIZE and moved["pool"] == 0


def test_a_restarted_worker_is_rebuilt_from_its_snapshot(cluster: Cluster) -> None:
    replica = Replica(cluster)
    replica.sync()
    _ask(cluster, _body("Warm both?"))
    replica.sync()
    url = cluster.prefill_urls[0]
    epoch = replica.policy.index.position(url)
    snapshots = replica.policy.index.num_snapshots
    cluster.restart("prefill-0")
    replica.sync()
    assert replica.policy.index.position(url) not in (None, epoch)
    assert replica.policy.index.num_snapshots == snapshots + 1
    assert replica.policy.index.held(url, "device") == set()  # a fresh engine holds nothing
    assert _ask(cluster, _body("Warm both?")) == _ask(cluster, _body("Warm both?"))


def test_the_event_doors_are_internal_and_refuse_bad_input(cluster: Cluster) -> None:
    url = f"{cluster.prefill_urls[1]}{CACHE_EVENTS_PATH}"
    assert httpx.get(url, timeout=10).status_code == 401  # no secret
    headers = internal_headers(cluster.internal_secret)
    resp = httpx.get(url, params={"since": "x"}, headers=headers, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "since"
    ahead = httpx.get(url, params={"since": 10**9}, headers=headers, timeout=10).json()
    assert ahead["gap"] is True and ahead["events"] == []
