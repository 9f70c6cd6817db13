"""Early decode in the router (orchestrator.prefetch): D picked at the start gets a prefetch
beside P's prefill, the decode prefers it, and every request that does not end in that D's
decode releases it. Real loopback HTTP against scripted P and D (test_metrics_flow.cluster)."""

from __future__ import annotations

import re

from pdrouter.router.orchestrator import OrchestratorConfig
from pdrouter.wire.pd import PrefetchRequest, prefill_request_json
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, cluster
from tests.wait import async_wait_until

CHAT = "/v1/chat/completions"
# Every prompt through P: the scripted prompts are short, and conditional disaggregation
# would leave them to D (and early decode sends those no prefetch).
THROUGH_P = OrchestratorConfig(retry_backoff_s=0.001, local_prefill_below_tokens=0)


def _count(text: str, outcome: str) -> float:
    found = re.search(rf'^pdrouter_prefetch_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    assert found, f"no pdrouter_prefetch_total for {outcome}"
    return float(found.group(1))


async def test_the_decode_goes_to_the_prefetched_d_and_adopts_it() -> None:
    async with cluster(num_d=3, orchestrator=THROUGH_P) as c:
        for n in range(6):
            rid = f"early-{n}"
            resp = await c.client.post(CHAT, json=STREAM_BODY, headers={"X-Request-Id": rid})
            assert resp.status_code == 200
            prefetched = [d for d in c.ds if rid in d.prefetched]
            decoded = [d for d in c.ds if rid in d.request_ids]
            assert len(prefetched) == 1 and decoded == prefetched  # the same D
        assert sum(len(d.prefetched) for d in c.ds) == 6
        assert all(len(d.prefetched) == 2 for d in c.ds)  # the decode policy spreads them
        assert [d.released for d in c.ds] == [[], [], []]  # adopted: nothing to release
        text = (await c.client.get("/metrics")).text
        assert (_count(text, "accepted"), _count(text, "adopted")) == (6, 6)
        assert _count(text, "released") == 0


async def test_a_prefill_that_fails_for_good_releases_the_prefetch() -> None:
    async with cluster(orchestrator=THROUGH_P) as c:
        c.ps[0].statuses = [500, 500, 500]
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "p-dead"})
        assert resp.status_code == 502
        d = c.ds[0]
        await async_wait_until(lambda: d.released, 5, "the prefetch released")
        assert (d.prefetched, d.released, d.request_ids) == (["p-dead"], ["p-dead"], [])


async def test_a_prefill_retried_keeps_the_prefetch_for_the_retry() -> None:
    async with cluster(num_p=2, orchestrator=THROUGH_P) as c:
        c.ps[0].statuses = [500]  # round robin tries it first
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "p-retry"})
        assert resp.status_code == 200
        assert [p.request_ids for p in c.ps] == [["p-retry"], ["p-retry"]]
        d = c.ds[0]
        assert (d.prefetched, d.request_ids, d.released) == (["p-retry"], ["p-retry"], [])


async def test_a_refused_prefetch_changes_nothing_and_is_not_released() -> None:
    async with cluster(num_d=2, orchestrator=THROUGH_P) as c:
        for d in c.ds:
            d.prefetch_statuses = [503]
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "full"})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert [d.released for d in c.ds] == [[], []]
        text = (await c.client.get("/metrics")).text
        assert (_count(text, "refused"), _count(text, "accepted")) == (1, 0)


async def test_a_decode_on_another_d_releases_the_prefetch() -> None:
    async with cluster(num_d=2, orchestrator=THROUGH_P) as c:
        first, other = c.ds  # round robin picks the first for the prefetch
        first.statuses = [500]  # its decode fails: a retry on the other
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "moved"})
        assert resp.status_code == 200
        assert (first.prefetched, other.prefetched) == (["moved"], [])
        assert first.request_ids == ["moved"] and other.request_ids == ["moved"]
        await async_wait_until(lambda: first.released, 5, "the prefetch released")
        assert first.released == ["moved"] and other.released == []


async def test_a_prompt_d_will_prefill_itself_gets_no_prefetch() -> None:
    async with cluster() as c:  # the default threshold: "hi" is far below it
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "short"})
        assert resp.status_code == 200
        assert (c.ds[0].prefetched, c.ds[0].request_ids) == ([], ["short"])


async def test_no_early_decode_sends_no_prefetch() -> None:
    async with cluster(orchestrator=OrchestratorConfig(early_decode=False)) as c:
        resp = await c.client.post(CHAT, json=BODY, headers={"X-Request-Id": "late"})
        assert resp.status_code == 200
        assert (c.ds[0].prefetched, c.ds[0].request_ids) == ([], ["late"])
        timeline = (await c.client.get("/debug/requests/late")).json()
        assert not any(e["event"].startswith("prefetch") for e in timeline["events"])


def test_the_prefetch_is_the_prefill_request_document() -> None:
    scope = "ab" * 32
    sent = prefill_request_json("r-1", "chat", b'{"model":"m","seed":3}', scope)
    req = PrefetchRequest.model_validate_json(sent)
    assert (req.request_id, req.endpoint, req.body, req.cache_scope) == (
        "r-1", "chat", {"model": "m", "seed": 3}, scope,
    )  # fmt: skip
