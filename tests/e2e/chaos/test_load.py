"""200 concurrent streaming requests across 2 P and 2 D: every one answered in full, none lost,
both of each role used, nothing held afterwards; a sample checked token for token against the
same requests sent one at a time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse

from pdrouter.launch.cluster import Cluster
from tests.e2e.chaos.conftest import MODEL, assert_nothing_held, chaos_spec, restart_dead
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import client, complete, prompt_ids
from tests.metrics_scrape import metrics_of
from tests.wait import async_wait_until

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
MAX_TOKENS = 16
BOUND_S = 240.0  # the whole load; a lost request would hang the gather past it
# 200 streams of up to 33 + 256 tokens are 58K tokens in flight when all of them reach D at
# once (a loaded machine streams slowly enough for that), beyond the default 2 batches of two
# D's KV cache (2 x 2 x 640 x 16 = 41K tokens): the router would refuse the excess up front
# (tests/e2e/chaos/test_overload.py). Here every request must be served: 4 batches.
BATCHES_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    """The chaos cluster with a decode event bound that covers admission under this load: a
    D that takes over a hundred streams at once (its KV holds ~35 of them) recomputes their
    generated tokens in small prefill chunks before its first event of each, and the others
    wait their turn silent: on a loaded 2-core machine one such wait passed 60 s."""
    log_dir = tmp_path_factory.mktemp("chaos-load-logs")
    router_args = (f"--batches-in-flight-per-instance={BATCHES_IN_FLIGHT}",)
    spec = chaos_spec(log_dir, chaos_cache_dir, decode_timeout_s=120.0, router_args=router_args)
    yield from started_cluster(spec)


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": prompt_ids(20 + i % 13, salt=100 + i),
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def _one(
    http: httpx.AsyncClient, url: str, i: int, body: dict
) -> tuple[int, str, int, str | None]:
    """(status, text, completion tokens, finish reason) of request i (body)."""
    texts: list[str] = []
    usage, finish = None, None
    async with aconnect_sse(http, "POST", url, json=body) as source:
        if source.response.status_code != 200:
            await source.response.aread()
            return source.response.status_code, source.response.text, 0, None
        async for event in source.aiter_sse():
            if event.data == "[DONE]":
                break
            data = json.loads(event.data)
            assert "error" not in data, f"request {i}: {data}"
            for choice in data["choices"]:
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
            usage = data.get("usage") or usage
    assert usage is not None, f"request {i}: no usage chunk"
    return 200, "".join(texts), usage["completion_tokens"], finish


def _router_failures(c: Cluster) -> dict[str, float]:
    """The router's failure counters and breaker states: what an assertion message needs."""
    words = ("stage_failures", "breaker", "retries", "failovers", "rejected")
    return {k: v for k, v in metrics_of(c.router_url).items() if any(w in k for w in words)}


def _failure_counts(c: Cluster) -> dict[str, float]:
    """Every failure, retry and failover counter of the router (totals only)."""
    return {k: v for k, v in _router_failures(c).items() if "_total" in k}


def _served(urls: list[str], endpoint: str) -> list[float]:
    key = f'pdworker_requests_total{{endpoint="{endpoint}",status="success"}}'
    return [metrics_of(url).get(key, 0) for url in urls]


async def test_200_concurrent_streams_across_2p2d_none_lost(cluster: Cluster) -> None:
    sample = {i: complete(client(cluster.router_url), False,
                          **{k: v for k, v in _body(i).items()
                             if k not in ("stream", "stream_options", "ignore_eos")},
                          extra_body={"ignore_eos": True})
              for i in (0, 57, 133, 199)}  # fmt: skip
    prefill_before = _served(cluster.prefill_urls, "prefill")
    decode_before = _served(cluster.decode_urls, "decode")
    url = f"{cluster.router_url}/v1/completions"
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as http:
        results = await asyncio.wait_for(
            asyncio.gather(*(_one(http, url, i, _body(i)) for i in range(NUM_REQUESTS))), BOUND_S
        )
    statuses = [status for status, *_ in results]
    assert statuses == [200] * NUM_REQUESTS, (
        [r for r in results if r[0] != 200][:3],
        _router_failures(cluster),
    )
    assert [(n, finish) for _, _, n, finish in results] == [(MAX_TOKENS, "length")] * NUM_REQUESTS
    for i, expected in sample.items():
        assert results[i][1] == expected.text, f"request {i} differs from its sequential run"
    prefill_delta = [a - b for a, b in zip(_served(cluster.prefill_urls, "prefill"),
                                           prefill_before, strict=True)]  # fmt: skip
    decode_delta = [a - b for a, b in zip(_served(cluster.decode_urls, "decode"),
                                          decode_before, strict=True)]  # fmt: skip
    assert sum(prefill_delta) == NUM_REQUESTS and min(prefill_delta) > 0, prefill_delta
    assert sum(decode_delta) == NUM_REQUESTS and min(decode_delta) > 0, decode_delta
    assert_nothing_held(cluster)


async def test_200_concurrent_streams_survive_a_decode_killed_under_them(
    cluster: Cluster,
) -> None:
    """The same load, longer streams, sent twice: undisturbed, then with one D killed while it
    streams. The killed D's streams resume on the other: every request gets the
    undisturbed run's tokens, in order, exactly once."""
    max_tokens = 256
    bodies = [{**_body(i), "max_tokens": max_tokens} for i in range(NUM_REQUESTS)]
    failovers_key = 'pdrouter_failovers_total{stage="decode"}'
    retries_key = 'pdrouter_retries_total{stage="decode"}'
    url = f"{cluster.router_url}/v1/completions"
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)

    async def kill_when_streaming() -> int:
        """Kill decode-1 once it streams 8 or more requests; how many it was running."""
        victim_url = cluster.decode_urls[1]
        m = await async_wait_until(
            lambda: asyncio.to_thread(metrics_of, victim_url), BOUND_S, "decode-1 streaming 8",
            done=lambda m: m["pdworker_num_requests_running"] >= 8,
        )  # fmt: skip
        cluster.child("decode-1").proc.kill()
        return int(m["pdworker_num_requests_running"])

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as http:

        async def load() -> list[tuple[int, str, int, str | None]]:
            jobs = (_one(http, url, i, bodies[i]) for i in range(NUM_REQUESTS))
            return await asyncio.wait_for(asyncio.gather(*jobs), BOUND_S)

        # Right after the first test's load: connections it left idle in the router's pool
        # must not be reused as the workers close them (no call may fail, none retried).
        failures_before = _failure_counts(cluster)
        undisturbed = await load()
        assert [r[0] for r in undisturbed] == [200] * NUM_REQUESTS
        assert _failure_counts(cluster) == failures_before
        before = metrics_of(cluster.router_url)
        failovers_before = before.get(failovers_key, 0)
        retries_before = before.get(retries_key, 0)
        killer = asyncio.ensure_future(kill_when_streaming())
        try:
            results = await load()
        finally:
            if not killer.done():
                killer.cancel()
            await asyncio.gather(killer, return_exceptions=True)
        assert not killer.cancelled(), "the load ended before decode-1 streamed 8 requests"
        num_on_victim = killer.result()
    statuses = [status for status, *_ in results]
    assert statuses == [200] * NUM_REQUESTS, (
        [r for r in results if r[0] != 200][:3],
        _router_failures(cluster),
    )
    assert [(n, f) for _, _, n, f in results] == [(max_tokens, "length")] * NUM_REQUESTS
    differ = [i for i in range(NUM_REQUESTS) if results[i][1] != undisturbed[i][1]]
    assert differ == [], f"{len(differ)} streams differ from their undisturbed run: {differ[:5]}"
    # Every stream decode-1 held moved to the other D: a failover if the router had relayed one
    # of its events, a retry if D had admitted it but sent nothing yet.
    after = metrics_of(cluster.router_url)
    moved = after[retries_key] - retries_before
    assert moved >= num_on_victim, (moved, num_on_victim)
    assert after[failovers_key] - failovers_before >= 1
    restart_dead(cluster, "decode-1")  # and back in the router's rotation, for the next test
    assert_nothing_held(cluster)
