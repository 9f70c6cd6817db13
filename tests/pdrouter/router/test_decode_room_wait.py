"""A request the decode side has no room for now: with the router's queue on
(--max-queued-requests) it waits for a request to end, within --max-queue-wait-s, instead of
a 429 at once; one that can never fit is a 400 at once. Real loopback HTTP, scripted workers
(tests/pdrouter/router/scripted_workers.py), D's stream held open by its gate.

D here holds 8 tokens (2 batches of 1 KV block of 4 tokens); each request may hold 5 (its
prompt estimate, 1, plus max_tokens 4): one fits, two do not.
"""

from __future__ import annotations

import asyncio

from pdrouter.router.tenancy.gate import TenancyConfig
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, cluster
from tests.wait import async_wait_until


async def test_a_request_waits_in_the_queue_for_the_decode_sides_room() -> None:
    tenancy = TenancyConfig(max_queued_requests=4, max_queue_wait_s=30)
    async with cluster(tenancy=tenancy) as c:
        c.service.registry.decode[0].num_kv_blocks = 1
        c.ds[0].gate = asyncio.Event()
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as first:
            assert first.status_code == 200
            second = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=BODY))
            # It holds a --max-in-flight slot and waits there: P has not seen it.
            await async_wait_until(lambda: c.service.admission.num_in_flight == 2, 10,
                                   "the second request waiting for room")  # fmt: skip
            assert len(c.ps[0].request_ids) == 1 and not second.done()
            assert c.service.selector.reserved_tokens["decode"] == 5
            c.ds[0].gate.set()
            await first.aread()
        resp = await second
        assert resp.status_code == 200
        assert len(c.ps[0].request_ids) == 2
    assert c.service.selector.reserved_tokens["decode"] == 0


async def test_the_wait_ends_in_a_429_naming_what_is_held_and_a_400_never_waits() -> None:
    tenancy = TenancyConfig(max_queued_requests=4, max_queue_wait_s=0.3)
    async with cluster(tenancy=tenancy) as c:
        c.service.registry.decode[0].num_kv_blocks = 1
        c.ds[0].gate = asyncio.Event()
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as first:
            assert first.status_code == 200
            resp = await c.client.post("/v1/chat/completions", json=BODY)
            assert (resp.status_code, resp.headers["Retry-After"]) == (429, "1")
            assert resp.json()["error"]["message"] == (
                "the decode side is full: requests in flight hold 5 of its 8 tokens and this "
                "request may hold 5 (its prompt plus max_tokens, or what the context leaves, "
                "times its sequences); retry later"
            )
            too_large = await c.client.post(
                "/v1/chat/completions", json={**BODY, "max_tokens": 8}
            )  # 9 tokens: more than D ever holds
            assert too_large.status_code == 400
            assert too_large.json()["error"]["code"] == "request_too_large"
            c.ds[0].gate.set()
            await first.aread()
        assert len(c.ps[0].request_ids) == 1  # P saw neither refused request
        assert c.service.admission.num_in_flight == 0
