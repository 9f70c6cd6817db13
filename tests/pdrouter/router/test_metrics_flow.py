"""The router's load, breaker, admission and metrics paths over real loopback HTTP, against
scripted P and D servers (tests/pdrouter/router/scripted_workers.py): exact counts and states."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances import health
from pdrouter.router.instances.registry import Registry
from pdrouter.router.orchestrator import OrchestratorConfig
from pdrouter.router.selection.admission import AdmissionConfig
from pdrouter.router.selection.breaker import BreakerConfig
from pdrouter.router.service import RouterService
from tests.pdrouter.router.scripted_workers import LoopServer, ScriptedWorker
from tests.sse import DONE, aiter_sse_data, chunk_texts, sse_data

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM_BODY = {**BODY, "stream": True}


class Cluster:
    def __init__(self, url: str, ps: list[ScriptedWorker], ds: list[ScriptedWorker],
                 service: RouterService) -> None:  # fmt: skip
        self.url, self.ps, self.ds, self.service = url, ps, ds, service
        self.client = httpx.AsyncClient(base_url=url, timeout=10)
        self.service_app: Any = None  # the router's ASGI app, for raw ASGI calls


@contextlib.asynccontextmanager
async def cluster(num_p: int = 1, num_d: int = 1, **cfg: Any) -> AsyncIterator[Cluster]:
    ps = [ScriptedWorker("prefill") for _ in range(num_p)]
    ds = [ScriptedWorker("decode") for _ in range(num_d)]
    started: list[Any] = []
    try:
        for w in ps + ds:
            await w.start()
            started.append(w)
        cfg.setdefault("orchestrator", OrchestratorConfig(retry_backoff_s=0.001))
        cfg.setdefault("health_interval_s", 60.0)  # no background checks unless asked for
        config = RouterConfig(
            prefill_urls=tuple(w.url for w in ps), decode_urls=tuple(w.url for w in ds), **cfg
        )
        registry = Registry(list(config.prefill_urls), list(config.decode_urls))
        async with httpx.AsyncClient() as client:
            await health.startup(registry, client, wait_s=5)
        app = create_app(config, registry)
        router = LoopServer(app, lifespan="on")
        await router.start()
        started.append(router)
        c = Cluster(router.url, ps, ds, app.state.service)
        c.service_app = app
        try:
            yield c
        finally:
            await c.client.aclose()
    finally:
        for server in reversed(started):
            await server.stop()


def _sse_texts(resp: httpx.Response) -> list[str]:
    return chunk_texts(sse_data(resp))


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + ("{" + labels + "}" if labels else "")) + r" ([0-9.e+-]+)"
    found = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    assert found, f"{name}{{{labels}}} not in /metrics"
    return float(found.group(1))


async def test_stream_metrics_timeline_and_request_id() -> None:
    async with cluster() as c:
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY,
                                   headers={"X-Request-Id": "req-flow-1"})  # fmt: skip
        assert resp.status_code == 200
        assert resp.headers["X-Request-Id"] == "req-flow-1"
        assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="200"') == 1
        assert _metric(text, "pdrouter_pool_blocks_total", 'outcome="hit",stage="prefill"') == 1
        assert _metric(text, "pdrouter_pool_blocks_total", 'outcome="miss",stage="prefill"') == 1
        assert _metric(text, "pdrouter_pool_blocks_total", 'outcome="hit",stage="decode"') == 1
        assert _metric(text, "pdrouter_pool_blocks_total", 'outcome="miss",stage="decode"') == 1
        assert _metric(text, "pdrouter_pool_bytes_written_total") == 4096
        assert _metric(text, "pdrouter_pool_bytes_read_total") == 2048
        assert _metric(text, "pdrouter_recomputed_prompt_tokens_total") == 2
        by_source = "pdrouter_prompt_tokens_by_source_total"
        assert _metric(text, by_source, 'source="device"') == 0
        assert _metric(text, by_source, 'source="pool"') == 4
        assert _metric(text, by_source, 'source="computed"') == 2
        assert _metric(text, "pdrouter_handoff_put_seconds_count") == 1
        assert _metric(text, "pdrouter_handoff_put_seconds_sum") == pytest.approx(0.003)
        assert _metric(text, "pdrouter_handoff_put_wait_seconds_sum") == pytest.approx(0.0015)
        assert _metric(text, "pdrouter_handoff_get_seconds_sum") == pytest.approx(0.004)
        assert _metric(text, "pdrouter_prefill_worker_seconds_sum") == pytest.approx(0.008)
        assert _metric(text, "pdrouter_prefill_seconds_count") == 1
        assert _metric(text, "pdrouter_inter_token_latency_seconds_count") == 3
        assert _metric(text, "pdrouter_time_to_first_token_seconds_count") == 1
        assert _metric(text, "pdrouter_request_seconds_count") == 1
        assert "pdrouter_retries_total{" not in text and "pdrouter_failovers_total{" not in text
        p_url, d_url = c.ps[0].url, c.ds[0].url
        key = f'role="decode",url="{d_url}"'
        assert _metric(text, "pdrouter_instance_in_flight", key) == 0
        assert _metric(text, "pdrouter_instance_breaker_state", key) == 0

        timeline = (await c.client.get("/debug/requests/req-flow-1")).json()
        assert [e["event"] for e in timeline["events"]] == [
            "router_accept", "prefill_sent", "prefill_done", "disaggregation",
            "first_token_sent", "decode_sent", "first_decode_token", "second_token_sent", "end",
        ]  # fmt: skip
        at_ms = [e["at_ms"] for e in timeline["events"]]
        assert at_ms == sorted(at_ms) and at_ms[0] == 0.0
        assert timeline["status"] == 200 and timeline["events"][-1]["num_output_tokens"] == 4
        assert timeline["events"][1]["url"] == p_url and timeline["events"][5]["url"] == d_url
        assert timeline["prefill"] == {
            "url": p_url, "queue_compute_s": 0.004, "engine_queue_s": 0.001,
            "engine_compute_s": 0.0025, "d2h_s": 0.001, "put_s": 0.002, "write_wait_s": 0.0015,
            "total_s": 0.008, "num_blocks_written": 1, "num_blocks_skipped": 1,
            "num_bytes_written": 4096, "pool_lookup_s": 0.0, "pool_load_s": 0.0,
            "prompt_tokens": {"device": 0, "host": 0, "pool": 4, "computed": 2},
        }  # fmt: skip
        assert timeline["decode"] == {
            "url": d_url, "alloc_wait_s": 0.0005, "get_s": 0.003, "h2d_s": 0.001,
            "ttft_s": 0.006, "num_blocks_loaded": 1, "num_tokens_recomputed": 2,
            "num_bytes_read": 2048, "num_blocks_loaded_ahead": None,
        }  # fmt: skip


async def test_every_response_carries_a_request_id() -> None:
    async with cluster(api_key="k1", admin_key="a1") as c:
        paths = ["/health", "/metrics", "/nowhere", "/v1/completions", "/debug/requests/x"]
        for method, path in zip(["GET", "GET", "GET", "POST", "GET"], paths, strict=True):
            resp = await c.client.request(method, path)
            assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"]), (path, resp)
        assert (await c.client.post("/v1/completions")).status_code == 401
        resp = await c.client.get("/health", headers={"X-Request-Id": "bad id!"})
        assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Request-Id"])
        resp = await c.client.get("/health", headers={"X-Request-Id": "mine-1"})
        assert resp.headers["X-Request-Id"] == "mine-1"
        # The debug endpoint needs the admin key, and names unknown ids.
        assert (await c.client.get("/debug/requests/x")).status_code == 401
        auth = {"Authorization": "Bearer a1"}
        resp = await c.client.get("/debug/requests/nope", headers=auth)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_request_id"


async def test_load_is_held_until_the_stream_ends_and_least_loaded_avoids_it() -> None:
    async with cluster(num_d=2, decode_policy="least_loaded") as c:
        d0, d1 = c.ds
        d0.gate = asyncio.Event()
        inst0, inst1 = c.service.registry.decode
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as held:
            assert held.status_code == 200
            events = aiter_sse_data(held)
            # P's first token, then two from D0.
            head = [await anext(events) for _ in range(3)]
            # Headers and three tokens are out; the stream is still open on D0: it counts
            # one request and its prompt (6) + max_tokens (4) tokens.
            assert (inst0.in_flight, inst0.in_flight_tokens) == (1, 6 + 4)
            for _ in range(2):
                resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY)
                assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
            assert (len(d0.request_ids), len(d1.request_ids)) == (1, 2)
            text = (await c.client.get("/metrics")).text
            key = f'role="decode",url="{d0.url}"'
            assert _metric(text, "pdrouter_instance_in_flight", key) == 1
            assert _metric(text, "pdrouter_instance_in_flight_tokens", key) == 10
            d0.gate.set()
            rest = [data async for data in events]
        assert "".join(chunk_texts(head + rest)) == " t0 t1 t2 t3"
        assert rest[-1] == DONE
        assert (inst0.in_flight, inst0.in_flight_tokens, inst1.in_flight) == (0, 0, 0)


async def test_breaker_opens_on_5xx_then_503_and_never_on_4xx() -> None:
    async with cluster(breaker=BreakerConfig(failure_threshold=2, cooldown_s=300)) as c:
        p = c.ps[0]
        p.statuses = [400, 400, 400]
        for _ in range(3):
            assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 400
        assert c.service.breakers.get(p.url).consecutive_failures == 0
        p.statuses = [500, 500]
        for _ in range(2):
            resp = await c.client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 502 and "prefill failed" in resp.json()["error"]["message"]
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 503
        assert resp.headers["Retry-After"] == "300"
        assert "circuit breaker" in resp.json()["error"]["message"]
        assert len(p.request_ids) == 5  # the open breaker kept the last request off P
        text = (await c.client.get("/metrics")).text
        key = f'role="prefill",url="{p.url}"'
        assert _metric(text, "pdrouter_instance_breaker_state", key) == 2
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="503"') == 1


async def test_global_limit_answers_429_without_queueing() -> None:
    async with cluster(admission=AdmissionConfig(max_in_flight=1, retry_after_s=2)) as c:
        c.ds[0].gate = asyncio.Event()
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as held:
            assert held.status_code == 200
            resp = await c.client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 429
            assert resp.headers["Retry-After"] == "2"
            assert resp.json()["error"]["code"] == "overloaded"
            assert len(c.ps[0].request_ids) == 1  # refused before any worker
            c.ds[0].gate.set()
            await held.aread()
        assert c.service.admission.num_in_flight == 0
        assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 200
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_rejected_total", 'limit="router"') == 1


async def test_per_instance_limit_checks_decode_before_prefill() -> None:
    async with cluster(admission=AdmissionConfig(max_in_flight_per_instance=1)) as c:
        c.ds[0].gate = asyncio.Event()
        async with c.client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as held:
            assert held.status_code == 200
            resp = await c.client.post("/v1/chat/completions", json=BODY)
            assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
            message = resp.json()["error"]["message"]
            assert message.startswith("every decode instance is at its in-flight limit")
            assert len(c.ps[0].request_ids) == 1  # P never saw the refused request
            c.ds[0].gate.set()
            await held.aread()
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_rejected_total", 'limit="decode"') == 1


async def test_decode_503_is_a_retry_on_another_decode_not_a_failover() -> None:
    async with cluster(num_d=2) as c:
        c.ds[0].statuses = [503]
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3"
        assert (len(c.ds[0].request_ids), len(c.ds[1].request_ids)) == (1, 1)
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_retries_total", 'stage="decode"') == 1
        assert 'pdrouter_failovers_total{stage="decode"}' not in text
        rid = resp.headers["X-Request-Id"]
        events = [
            e["event"] for e in (await c.client.get(f"/debug/requests/{rid}")).json()["events"]
        ]
        assert events.count("decode_sent") == 2 and "decode_retry" in events


async def test_decode_cut_mid_stream_is_a_failover_resumed_after_the_sent_tokens() -> None:
    async with cluster(num_d=2) as c:
        d0, d1 = c.ds
        d0.cut_after = 1  # D0 sends t1, then its stream ends unfinished
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY)
        assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
        assert d0.output_ids_seen == [[100]]
        assert d1.output_ids_seen == [[100, 101]]  # resumes after the tokens already sent
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_failovers_total", 'stage="decode"') == 1
        assert _metric(text, "pdrouter_retries_total", 'stage="decode"') == 1
        assert c.service.breakers.get(d0.url).consecutive_failures == 1
        assert c.service.breakers.get(d1.url).consecutive_failures == 0
        rid = resp.headers["X-Request-Id"]
        timeline = (await c.client.get(f"/debug/requests/{rid}")).json()
        moves = [e for e in timeline["events"] if e["event"] == "decode_failover"]
        assert len(moves) == 1 and moves[0]["url"] == d0.url
        assert "stream ended before the request finished" in moves[0]["error"]
        assert timeline["decode"]["url"] == d1.url


async def test_an_oversized_body_over_a_real_socket_is_413_and_the_next_request_is_served() -> None:
    async with cluster(max_body_bytes=64 * 1024) as c:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 1_000_000}]}
        resp = await c.client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
        assert c.ps[0].request_ids == []  # refused before any worker was touched
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="413"') == 1


async def test_an_internal_error_mid_stream_ends_the_stream_in_band_and_is_a_500() -> None:
    """The 200 is out when the router fails: an error event and [DONE] end the stream, the
    request counts as 500 and its timeline says what failed (not that the client left)."""
    async with cluster() as c:
        answers = c.service.answers
        assert answers is not None
        real_stream = answers.stream

        async def broken(ctx: Any, result: Any) -> AsyncIterator[bytes]:
            async for part in real_stream(ctx, result):
                yield part
                raise RuntimeError("scripted router bug")

        answers.stream = broken  # type: ignore[method-assign]
        headers = {"X-Request-Id": "bug-1"}
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY, headers=headers)
        assert resp.status_code == 200
        events = sse_data(resp)
        assert events[-1] == DONE
        assert json.loads(events[-2])["error"]["message"].startswith("internal router error")
        timeline = c.service.timelines.get("bug-1")
        assert timeline is not None and timeline.status == 500
        assert timeline.events[-1]["error"].startswith("internal router error")
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="500"') == 1
        assert _metric(text, "pdrouter_requests_in_progress") == 0


async def test_usage_reports_prefill_cached_tokens() -> None:
    """cached_tokens is P's num_cached_tokens (4 of 6 prompt tokens), streamed or not; D's
    load of P's handoff (1 block loaded) adds nothing to it."""
    async with cluster() as c:
        whole = (await c.client.post("/v1/chat/completions", json=BODY)).json()
        assert whole["usage"] == {
            "prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
        }  # fmt: skip
        body = {**STREAM_BODY, "stream_options": {"include_usage": True}}
        resp = await c.client.post("/v1/chat/completions", json=body)
        data = sse_data(resp)
        assert data[-1] == DONE
        assert json.loads(data[-2])["usage"] == whole["usage"]
