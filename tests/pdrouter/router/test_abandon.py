"""Calls to an instance that health checks find down, and that have had nothing from it for
--abandon-after-s, are given up (pdrouter.router.instances.call_guard).

Unit tests drive CallGuard with plain asyncio; the flow tests freeze a scripted P or D (it
neither answers nor closes, /health included) under a router whose read bounds are a minute
long: the request must move to the other instance once the checks declare the frozen one
down, long before any bound. A D that misses its checks while its stream goes on keeps it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdrouter.router.instances.call_guard import CallGuard, InstanceDown, abandon_stalled
from pdrouter.router.instances.instance import HealthThresholds
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, _metric, cluster
from tests.sse import aiter_sse_data, chunk_texts
from tests.wait import async_wait_until

# -- CallGuard ---------------------------------------------------------------------------


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_abandoning_a_waiting_call_raises_instance_down_and_leaves_no_cancel() -> None:
    calls: set[CallGuard] = set()
    outcome: list[object] = []

    async def call() -> None:
        with CallGuard(calls, "http://d") as guard:
            try:
                await guard.call(_forever())
            except InstanceDown as exc:
                outcome.append(exc)
            outcome.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]
            await asyncio.sleep(0)  # no cancellation left pending on the task

    task = asyncio.ensure_future(call())
    await async_wait_until(lambda: len(calls) == 1, 1.0, "the call to register its guard")
    next(iter(calls)).abandon("3 checks failed")
    await asyncio.wait_for(task, 1.0)
    assert isinstance(outcome[0], InstanceDown) and "3 checks failed" in str(outcome[0])
    assert outcome[1] == 0
    assert calls == set()


async def test_a_call_abandoned_while_busy_elsewhere_fails_at_its_next_read() -> None:
    calls: set[CallGuard] = set()
    with CallGuard(calls, "http://d") as guard:
        guard.abandon("down")  # not waiting on the worker: nothing is cancelled
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        with pytest.raises(InstanceDown):
            await guard.call(asyncio.sleep(0))


async def test_a_client_cancel_is_never_swallowed() -> None:
    calls: set[CallGuard] = set()

    async def call() -> None:
        with CallGuard(calls, "http://d") as guard:
            await guard.call(_forever())

    alone = asyncio.ensure_future(call())
    await async_wait_until(lambda: len(calls) == 1, 1.0, "the call to register its guard")
    alone.cancel()  # the client left, nothing is down
    with pytest.raises(asyncio.CancelledError):
        await alone
    both = asyncio.ensure_future(call())
    await async_wait_until(lambda: len(calls) == 1, 1.0, "the call to register its guard")
    guard = next(iter(calls))
    guard.abandon("down")
    both.cancel()  # the client left at the same moment: its cancellation wins
    # Both hit the task before it resumed: the abandon was delivered (not a no-op) ...
    assert guard.reason == "down"
    assert both.cancelling() == 2
    # ... and the task still ends cancelled, not with InstanceDown.
    with pytest.raises(asyncio.CancelledError):
        await both


async def test_reads_before_the_abandon_arrive_then_instance_down() -> None:
    calls: set[CallGuard] = set()
    second_read = asyncio.Event()

    async def body() -> asyncio.AsyncIterator[bytes]:  # type: ignore[name-defined]
        yield b"a"
        second_read.set()
        await _forever()
        yield b"never"

    got: list[bytes] = []

    async def read() -> None:
        with CallGuard(calls, "http://d") as guard:
            source = body()
            # As decode_stream.event_batches reads D's body: each read through the guard.
            while (chunk := await guard.call(anext(source, None))) is not None:
                got.append(chunk)

    task = asyncio.ensure_future(read())
    await asyncio.wait_for(second_read.wait(), 1.0)
    next(iter(calls)).abandon("down")
    with pytest.raises(InstanceDown):
        await asyncio.wait_for(task, 1.0)
    assert got == [b"a"]


async def test_only_calls_silent_for_long_enough_are_abandoned() -> None:
    calls: set[CallGuard] = set()
    with CallGuard(calls, "http://d") as quiet, CallGuard(calls, "http://d") as talking:
        quiet.last_active_s -= 5.0  # nothing from the worker for 5 s
        assert abandon_stalled(calls, "down", silent_for_s=2.0) == 1
        assert (quiet.reason, talking.reason) == ("down", None)
        assert abandon_stalled(calls, "down", silent_for_s=2.0) == 0  # not twice


# -- the router --------------------------------------------------------------------------

# Read bounds a minute long, health checks every 0.1 s, down after 2 failed checks, calls
# silent for 0.5 s on a down instance given up.
FROZEN = HealthThresholds(unhealthy_after=2, healthy_after=1, abandon_after_s=0.5)
PATIENT = {
    "orchestrator": OrchestratorConfig(
        retry_backoff_s=0.001, timeouts=HopTimeouts(prefill_s=60.0, decode_event_s=60.0)
    ),
    "health_interval_s": 0.1,
}


async def _metrics_text(c) -> str:
    return (await c.client.get("/metrics")).text


async def test_a_frozen_decode_mid_stream_is_left_for_another_one() -> None:
    async with cluster(num_d=2, **PATIENT) as c:
        service = c.service
        service.registry.thresholds = FROZEN
        for d in c.ds:
            d.gate = asyncio.Event()  # each D holds its stream before the final event
        lines: list[str] = []
        frozen = None
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY,
                                   timeout=30) as resp:  # fmt: skip
            assert resp.status_code == 200
            async for data in aiter_sse_data(resp):
                lines.append(data)
                if frozen is None and len(chunk_texts(lines)) == 3:
                    # P's " t0" and D's " t1", " t2" are out; the D waits on its gate.
                    frozen = next(d for d in c.ds if d.request_ids)
                    other = next(d for d in c.ds if d is not frozen)
                    assert other.gate is not None
                    other.gate.set()  # the D the stream moves to finishes at once
                    frozen.freeze()  # neither its stream nor /health answer from now on
        assert frozen is not None and frozen.gate is not None
        frozen.thaw()
        frozen.gate.set()
        assert chunk_texts(lines) == [" t0", " t1", " t2", " t3"]  # token for token
        assert other.output_ids_seen == [[100, 101, 102]]  # resumed after what was sent
        metrics = (await c.client.get("/metrics")).text
        kind = 'kind="InstanceDown",stage="decode"'
        assert _metric(metrics, "pdrouter_stage_failures_total", kind) == 1
        assert _metric(metrics, "pdrouter_failovers_total", 'stage="decode"') == 1
        assert not any(inst.calls for inst in service.registry.all())


async def test_a_frozen_prefill_is_retried_on_another_one() -> None:
    async with cluster(num_p=2, **PATIENT) as c:
        c.service.registry.thresholds = FROZEN
        c.ps[0].freeze()
        c.ps[1].freeze()
        request = asyncio.ensure_future(c.client.post("/v1/chat/completions", json=BODY,
                                                      timeout=30))  # fmt: skip
        await async_wait_until(
            lambda: any(p.request_ids for p in c.ps), 10, "a P to get the request"
        )
        stuck = next(p for p in c.ps if p.request_ids)
        other = next(p for p in c.ps if p is not stuck)
        other.thaw()  # only the P holding the request stays frozen
        resp = await request
        stuck.thaw()
        assert resp.status_code == 200, resp.text
        assert other.request_ids  # the retry went to the live P
        metrics = (await c.client.get("/metrics")).text
        kind = 'kind="InstanceDown",stage="prefill"'
        assert _metric(metrics, "pdrouter_stage_failures_total", kind) == 1
        assert not any(inst.calls for inst in c.service.registry.all())


async def test_a_client_that_leaves_while_p_is_frozen_is_still_a_499() -> None:
    """The client leaves while its P is frozen, then the checks declare that P down: the
    request is the client's 499, never an abandoned call (InstanceDown) or a 503. (The two
    hitting the task in one turn is test_a_client_cancel_is_never_swallowed.)"""
    async with cluster(num_p=1, **PATIENT) as c:
        c.service.registry.thresholds = FROZEN
        c.ps[0].freeze()
        async with httpx.AsyncClient(base_url=c.url) as leaving:
            request = asyncio.ensure_future(
                leaving.post("/v1/chat/completions", json=BODY, timeout=30)
            )
            await async_wait_until(lambda: c.ps[0].request_ids, 10, "P to get the request")
            request.cancel()  # the client leaves while P is frozen
            with pytest.raises(asyncio.CancelledError):
                await request
        p = c.service.registry.prefill[0]
        await async_wait_until(lambda: not p.healthy, 10, "the checks to declare P down")
        c.ps[0].thaw()
        metrics = await async_wait_until(
            lambda: _metrics_text(c), 10, "the router to hold no request",
            done=lambda m: _metric(m, "pdrouter_requests_in_progress") == 0,
        )  # fmt: skip
        assert _metric(metrics, "pdrouter_requests_total", 'endpoint="chat",status="499"') == 1
        assert 'kind="InstanceDown"' not in metrics
        assert not any(inst.calls for inst in c.service.registry.all())


async def test_a_decode_that_misses_its_checks_while_streaming_keeps_its_stream() -> None:
    """Busy, not frozen: /health does not answer, but the stream is silent for less than
    --abandon-after-s; it finishes on the same D, nothing is given up. (Checks that time out
    count as slow only within --busy-health-timeout-s of the stream's last event: D goes down
    after that, and the stream is kept all the same.)"""
    busy = HealthThresholds(
        unhealthy_after=2, healthy_after=1, abandon_after_s=5.0, busy_check_timeout_s=0.2
    )
    async with cluster(num_d=1, **PATIENT) as c:
        c.service.registry.thresholds = busy
        d = c.ds[0]
        d.gate = asyncio.Event()
        lines: list[str] = []
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY,
                                   timeout=30) as resp:  # fmt: skip
            assert resp.status_code == 200
            async for data in aiter_sse_data(resp):
                lines.append(data)
                if len(chunk_texts(lines)) == 3:
                    d.freeze()  # /health hangs from now on: the checks take D out
                    inst = c.service.registry.decode[0]
                    # Down by its checks, then a few more failed checks, the stream silent.
                    await async_wait_until(
                        lambda i=inst: (i.healthy, i.consecutive_failures), 10,
                        "D down and 2 more failed checks",
                        done=lambda s: not s[0] and s[1] >= busy.unhealthy_after + 2,
                    )  # fmt: skip
                    d.gate.set()
        d.thaw()
        assert chunk_texts(lines) == [" t0", " t1", " t2", " t3"]
        assert d.output_ids_seen == [[100]]  # one decode call: never moved
        metrics = (await c.client.get("/metrics")).text
        assert "InstanceDown" not in metrics
