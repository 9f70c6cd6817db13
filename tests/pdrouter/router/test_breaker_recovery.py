"""A recovered instance is served again: the burst after an incident.

A breaker that, once open, let one probe through after its cooldown and answered 503 to
everyone else would give the first burst after an incident mostly 503 although the health
checks called the instance healthy all along. So a passed check half-opens the breaker,
half-open admits `half_open_calls` trials at once, and requests that find them busy wait for
the first trial's verdict instead of failing. Over real loopback HTTP with scripted workers.
"""

from __future__ import annotations

import asyncio

from pdrouter.router.instances import health
from pdrouter.router.selection.breaker import BreakerConfig, BreakerState
from tests.pdrouter.router.test_metrics_flow import BODY, Cluster, _metric, cluster
from tests.wait import async_wait_until

BURST = 16


async def _open_prefill_breaker(c: Cluster) -> str:
    p = c.ps[0]
    p.statuses = [500, 500]
    for _ in range(2):
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 502, resp.text
    assert c.service.breakers.state(p.url) is BreakerState.OPEN
    assert c.service.registry.prefill[0].healthy  # 5xx answers never mark it down
    return p.url


async def _breaker_states(c: Cluster, url: str) -> tuple[float, str]:
    metrics = (await c.client.get("/metrics")).text
    gauge = _metric(metrics, "pdrouter_instance_breaker_state", f'role="prefill",url="{url}"')
    listed = (await c.client.get("/instances")).json()["instances"]
    (described,) = [inst for inst in listed if inst["url"] == url]
    assert described["healthy"] is True
    return gauge, described["breaker"]


async def test_a_burst_after_the_incident_is_served_by_trials_and_waiters() -> None:
    breaker = BreakerConfig(failure_threshold=2, cooldown_s=300, half_open_calls=2,
                            trial_wait_s=30)  # fmt: skip
    async with cluster(breaker=breaker) as c:
        url = await _open_prefill_breaker(c)
        assert await _breaker_states(c, url) == (2.0, "open")
        # The instance has recovered: its next health check passes, the breaker goes half-open.
        await health.check_all(c.service.registry, c.service.client, timeout_s=5)
        assert await _breaker_states(c, url) == (1.0, "half_open")
        # Hold P so the burst piles up behind the two trials: the race under test happens.
        c.ps[0].freeze()
        burst = [
            asyncio.ensure_future(c.client.post("/v1/chat/completions", json=BODY))
            for _ in range(BURST)
        ]
        await async_wait_until(lambda: len(c.service.in_flight), 10, "the burst in the router",
                               done=lambda n: n == BURST)  # fmt: skip
        await async_wait_until(
            lambda: len(c.ps[0].request_ids), 10, "both trials at P", done=lambda n: n == 4
        )  # fmt: skip  (2 failures + 2 trials)
        assert c.service.breakers.get(url).trials_in_flight == 2
        assert not any(task.done() for task in burst)  # the other 14 wait, none got 503
        c.ps[0].thaw()
        statuses = [resp.status_code for resp in await asyncio.gather(*burst)]
        assert statuses == [200] * BURST
        assert len(c.ps[0].request_ids) == 2 + BURST
        assert await _breaker_states(c, url) == (0.0, "closed")


async def test_a_request_right_after_the_incident_waits_for_the_next_passed_check() -> None:
    breaker = BreakerConfig(failure_threshold=2, cooldown_s=300, trial_wait_s=30)
    async with cluster(breaker=breaker, health_interval_s=0.2) as c:
        url = await _open_prefill_breaker(c)
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 200, resp.text  # not 503 for the next 300 s
        assert await _breaker_states(c, url) == (0.0, "closed")


async def test_a_failing_trial_reopens_and_requests_get_503_after_the_bounded_wait() -> None:
    breaker = BreakerConfig(failure_threshold=2, cooldown_s=300, trial_wait_s=0.2)
    async with cluster(breaker=breaker) as c:
        url = await _open_prefill_breaker(c)
        await health.check_all(c.service.registry, c.service.client, timeout_s=5)
        c.ps[0].statuses = [500]
        resp = await c.client.post("/v1/chat/completions", json=BODY)  # the trial fails
        assert resp.status_code == 502, resp.text
        assert c.service.breakers.state(url) is BreakerState.OPEN
        resp = await c.client.post("/v1/chat/completions", json=BODY)  # no check passes now
        assert resp.status_code == 503 and "circuit breaker" in resp.json()["error"]["message"]
        assert len(c.ps[0].request_ids) == 3  # 2 failures + the failed trial
