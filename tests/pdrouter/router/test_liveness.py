"""Busy is not down: the router tells a slow instance from a dead one by its progress.

Unit tests step the registry's clock and set a CallSet's last progress by hand, and check the
exact state after each health check; the flow tests run a scripted D whose /health hangs
while it streams: with a second call queued (silent) behind the first, neither is given up
and D stays healthy; and its long checks delay no other instance's."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from pdrouter.router.instances.call_guard import CallGuard, CallSet, abandon_stalled
from pdrouter.router.instances.instance import HealthThresholds
from pdrouter.router.instances.registry import Registry
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.pdrouter.router.test_metrics_flow import STREAM_BODY, Cluster, cluster
from tests.pdrouter.router.worker_health import worker_health
from tests.sse import aiter_sse_data, chunk_texts
from tests.wait import async_wait_until

THRESHOLDS = HealthThresholds(unhealthy_after=3, healthy_after=2, abandon_after_s=10.0)
INFO = worker_health("fp", block_size=16, max_num_seqs=4, num_kv_blocks=64)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _healthy_decode(clock: Clock) -> Registry:
    registry = Registry(["http://p"], ["http://d"], THRESHOLDS, clock)
    registry.check_passed(registry.decode[0], INFO)
    assert registry.decode[0].healthy
    return registry


def _state(registry: Registry) -> tuple[bool, int, int]:
    inst = registry.decode[0]
    return inst.healthy, inst.consecutive_failures, inst.num_slow_checks


def test_timeouts_of_an_instance_whose_calls_progress_count_as_slow() -> None:
    clock = Clock()
    registry = _healthy_decode(clock)
    inst = registry.decode[0]
    inst.calls.last_progress_s = clock.now_s - 1.0  # a stream had a token 1 s ago
    for n in range(1, 6):
        registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
        assert _state(registry) == (True, 0, n)
    assert inst.last_error == "slow, its calls progress: /health failed: ReadTimeout"
    clock.now_s += 3.9  # the token was 4.9 s ago: still within --busy-health-timeout-s (5 s)
    registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
    assert _state(registry) == (True, 0, 6)
    # Its progress ages past --busy-health-timeout-s: the same timeouts now count, down after 3.
    clock.now_s += 0.1
    registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
    assert _state(registry) == (True, 1, 6)
    registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
    registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
    assert _state(registry) == (False, 3, 6)


def test_a_refused_check_counts_even_while_calls_progress() -> None:
    clock = Clock()
    registry = _healthy_decode(clock)
    inst = registry.decode[0]
    inst.calls.last_progress_s = clock.now_s
    for n in range(1, 4):
        registry.check_failed(inst, "/health failed: ConnectError", slow=False)
        assert _state(registry) == (n < 3, n, 0)


def test_timeouts_of_an_idle_instance_count_as_failed() -> None:
    clock = Clock()
    registry = _healthy_decode(clock)
    inst = registry.decode[0]
    assert inst.calls.last_progress_s is None  # no call ever had anything
    for n in range(1, 4):
        registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
        assert _state(registry) == (n < 3, n, 0)


def test_a_slow_check_between_failed_ones_neither_resets_nor_adds() -> None:
    clock = Clock()
    registry = _healthy_decode(clock)
    inst = registry.decode[0]
    registry.check_failed(inst, "/health failed: ConnectError")
    inst.calls.last_progress_s = clock.now_s
    registry.check_failed(inst, "/health failed: ReadTimeout", slow=True)
    assert _state(registry) == (True, 1, 1)
    registry.check_passed(inst, INFO)
    assert _state(registry) == (True, 0, 1)


def test_the_worker_reported_batch_and_kv_come_from_health() -> None:
    registry = _healthy_decode(Clock())
    inst = registry.decode[0]
    assert (inst.max_num_seqs, inst.num_kv_blocks) == (4, 64)
    described = registry.describe_instance(inst)
    assert (described["max_num_seqs"], described["slow_checks"]) == (4, 0)


async def test_a_read_marks_progress_on_its_instance_and_a_failure_does_not() -> None:
    calls = CallSet()
    with CallGuard(calls, "http://d") as guard:
        assert calls.last_progress_s is None
        await guard.call(asyncio.sleep(0))
        first = calls.last_progress_s
        assert first is not None and first == guard.last_active_s

        async def fails() -> None:
            raise httpx.ReadError("reset")

        with contextlib.suppress(httpx.ReadError):
            await guard.call(fails())
        assert calls.last_progress_s == first


async def test_no_call_of_an_instance_that_progresses_is_abandoned() -> None:
    calls = CallSet()
    with CallGuard(calls, "http://d") as queued, CallGuard(calls, "http://d") as streaming:
        queued.last_active_s -= 30.0  # queued behind the other: nothing for 30 s
        calls.last_progress_s = streaming.last_active_s  # the other just had a token
        assert abandon_stalled(calls, "down", silent_for_s=10.0) == 0
        assert (queued.reason, streaming.reason) == (None, None)
        calls.last_progress_s -= 10.0  # nothing anywhere for 10 s: the queued call is hung
        assert abandon_stalled(calls, "down", silent_for_s=10.0) == 1
        assert (queued.reason, streaming.reason) == ("down", None)


# -- the router --------------------------------------------------------------------------

# Health checks every 0.1 s, down after 2 failed checks, calls silent for 0.5 s on a down
# instance given up: quick to give up anything that looks hung. Busy for 1 s after a token (its
# check waits that long; 10 token gaps): a check that times out then counts as failed only
# after the event loop stalled ~1 s, not the 0.2 s a loaded 2-core CI machine can stall it for
# (a 0.3 s window counted one failed check there).
QUICK = HealthThresholds(
    unhealthy_after=2, healthy_after=1, abandon_after_s=0.5, busy_check_timeout_s=1.0
)
PATIENT = {
    "orchestrator": OrchestratorConfig(
        retry_backoff_s=0.001, timeouts=HopTimeouts(prefill_s=60.0, decode_event_s=60.0)
    ),
    "health_interval_s": 0.1,
}
NUM_TOKENS = 20  # a token every 0.1 s: the first stream lasts 1.9 s
QUEUED_S = 1.5  # the second decode call's wait for its first event: 3 x --abandon-after-s


async def _stream(c: Cluster) -> list[str]:
    lines: list[str] = []
    async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY,
                               timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        async for data in aiter_sse_data(resp):
            lines.append(data)
    return lines


async def test_a_call_queued_behind_a_stream_on_a_saturated_decode_is_kept() -> None:
    """D's /health never answers while it streams one call (a token every 0.1 s) and holds a
    second one silent for 1.5 s before its first token (queued behind the first): its checks
    count as slow, D stays healthy, and both streams end on D in full."""
    async with cluster(num_d=1, **PATIENT) as c:
        c.service.registry.thresholds = QUICK
        d = c.ds[0]
        d.num_tokens = NUM_TOKENS
        d.event_gap_s = 0.1
        d.first_event_delays_s = [0.0, QUEUED_S]
        d.health_gate = asyncio.Event()
        inst = c.service.registry.decode[0]
        try:
            first = asyncio.ensure_future(_stream(c))
            await async_wait_until(lambda: len(d.output_ids_seen), 5, "the first decode call",
                                   done=lambda n: n == 1)  # fmt: skip
            second = asyncio.ensure_future(_stream(c))
            results = await asyncio.wait_for(asyncio.gather(first, second), 20)
        finally:
            d.health_gate.set()
        expected = [f" t{k}" for k in range(NUM_TOKENS)]
        for lines in results:
            assert "error" not in "".join(lines)
            assert chunk_texts(lines) == expected
            assert lines[-1] == "[DONE]"
        assert len(d.output_ids_seen) == 2  # two decode calls, neither moved
        assert (inst.healthy, inst.consecutive_failures) == (True, 0)
        assert inst.num_slow_checks >= 2  # ~3.4 s of streams, a check hung 1 s at a time
        metrics = (await c.client.get("/metrics")).text
        assert "InstanceDown" not in metrics
        assert 'pdrouter_instance_slow_checks_total{role="decode"' in metrics


async def test_a_busy_instances_long_check_delays_no_other_instances_checks() -> None:
    """D0 streams (busy) and its /health hangs: each of its checks waits the busy window (2 s);
    meanwhile D1 is checked every interval as usual, not once per D0's check."""
    window = HealthThresholds(abandon_after_s=10.0, busy_check_timeout_s=2.0)
    async with cluster(num_d=2, **PATIENT) as c:
        c.service.registry.thresholds = window
        busy, idle = c.ds
        for d in c.ds:
            d.num_tokens, d.event_gap_s = 30, 0.1  # 3 s of stream on whichever D gets it
            d.health_gate = asyncio.Event()
        idle.health_gate.set()
        try:
            stream = asyncio.ensure_future(_stream(c))
            await async_wait_until(lambda: len(busy.output_ids_seen) + len(idle.output_ids_seen),
                                   5, "the decode call", done=lambda n: n == 1)  # fmt: skip
            if idle.output_ids_seen:  # the stream went to D1: swap the roles
                busy, idle = idle, busy
                busy.health_gate, idle.health_gate = idle.health_gate, busy.health_gate
            registry = c.service.registry
            d0 = next(inst for inst in registry.decode if inst.url == busy.url)
            await async_wait_until(lambda: registry.busy(d0), 5, "D0's stream to progress")
            before = (busy.num_health_checks, idle.num_health_checks)
            await async_wait_until(lambda: idle.num_health_checks - before[1], 5,
                                   "D1 checked five times", done=lambda n: n >= 5)  # fmt: skip
            after = (busy.num_health_checks, idle.num_health_checks)
        finally:
            busy.health_gate.set()
        assert after[0] - before[0] <= 1  # one check waiting out its 2 s window at most
        assert after[1] - before[1] >= 5  # every 0.1 s interval, not every 2 s
        lines = await asyncio.wait_for(stream, 10)
        assert lines[-1] == "[DONE]"
