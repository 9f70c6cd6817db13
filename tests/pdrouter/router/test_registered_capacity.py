"""A registered capacity bounds the calls the router sends an instance (no flag needed): at
its bound the instance is not picked, and with every instance at its bound a request is
refused with 429 + Retry-After before any worker sees it. Real loopback HTTP, scripted
workers."""

from __future__ import annotations

import asyncio

from pdrouter.router.instances.instance import Instance
from pdrouter.router.instances.registry import Registry
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, _metric, cluster


def _register(registry: Registry, inst: Instance, capacity: int) -> None:
    # What POST /instances does with a worker's registration of an already known URL.
    assert inst.fingerprint is not None and inst.block_size is not None
    registry.register(inst.role, inst.url, inst.fingerprint, inst.block_size, capacity=capacity)


async def test_an_instance_at_its_capacity_is_skipped_then_all_full_is_429_up_front() -> None:
    async with cluster(num_p=1, num_d=2) as c:
        registry = c.service.registry
        d0, d1 = registry.decode
        _register(registry, d0, capacity=1)
        _register(registry, d1, capacity=1)
        for w in c.ds:
            w.gate = asyncio.Event()
        async with (
            c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as first,
            c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as second,
        ):
            assert (first.status_code, second.status_code) == (200, 200)
            # Each decode instance holds one stream: the second went to the one with room.
            assert (d0.in_flight, d1.in_flight) == (1, 1)
            resp = await c.client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
            assert error["message"].startswith(
                "every decode instance is at its in-flight limit: 2 of 2 calls held (2 on "
                f"decode instances, 0 in prefill to come; {d0.url} 1/1 calls, "
                f"{d1.url} 1/1 calls;"
            )
            assert len(c.ps[0].request_ids) == 2  # P never saw the refused request
            for w in c.ds:
                w.gate.set()
            await first.aread()
            await second.aread()
        assert (d0.in_flight, d1.in_flight) == (0, 0)
        assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 200
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_rejected_total", 'limit="decode"') == 1
