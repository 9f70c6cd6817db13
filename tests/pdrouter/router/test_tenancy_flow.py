"""Keys-file limits, priorities and traces through a router on loopback, against scripted P
and D servers (tests/pdrouter/router/scripted_workers.py), the spans through the SDK's real
OTLP/HTTP exporter to a collector on a loopback port (tests/otlp_collector.py)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrouter.common.tracing import TracingConfig, span_id
from pdrouter.router.tenancy.gate import TenancyConfig
from tests.otlp_collector import Collector
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, _metric, cluster
from tests.wait import async_wait_until

KEYS = {"keys": [
    {"id": "team-a", "key": "sk-team-a", "requests_per_minute": 2, "priority": 3},
    {"id": "batch", "key": "sk-batch"},
]}  # fmt: skip


ADMIN_KEY = "admin-tenancy"


def keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


async def test_a_key_past_its_limit_gets_429_naming_it_and_usage_is_counted_by_id(
    tmp_path: Path,
) -> None:
    tenancy = TenancyConfig(api_keys_file=keys_file(tmp_path))
    # With a keys file /metrics and /debug/* need the admin key (pdrouter.common.doors).
    async with cluster(tenancy=tenancy, admin_key=ADMIN_KEY) as c:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        team_a = {"Authorization": "Bearer sk-team-a"}
        assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 401
        assert (await c.client.get("/v1/models")).status_code == 401
        assert (await c.client.get("/v1/models", headers=team_a)).status_code == 200
        began_s = time.monotonic()
        for _ in range(2):
            assert (await c.client.post("/v1/chat/completions", json=BODY,
                                        headers=team_a)).status_code == 200  # fmt: skip
        resp = await c.client.post("/v1/chat/completions", json=BODY, headers=team_a)
        took_s = time.monotonic() - began_s
        assert resp.status_code == 429
        # Its bucket refills one request per 30 s from the first: the wait left is 30 s less
        # what the three calls took, rounded up (29 once they took over a second, under load).
        assert math.ceil(30 - took_s) <= int(resp.headers["Retry-After"]) <= 30
        assert resp.json()["error"] == {
            "message": "API key 'team-a' is past its limit of 2 requests per minute "
            "(requests_per_minute); retry later",
            "type": "rate_limit_error", "param": "requests_per_minute",
            "code": "rate_limit_exceeded",
        }  # fmt: skip
        refused = resp.headers["X-Request-Id"]
        timeline = (await c.client.get(f"/debug/requests/{refused}", headers=admin)).json()
        assert (timeline["status"], timeline["events"][-1]["stage"]) == (429, "requests_per_minute")
        batch = {"Authorization": "Bearer sk-batch"}
        assert (await c.client.post("/v1/chat/completions", json=BODY,
                                    headers=batch)).status_code == 200  # fmt: skip
        text = (await c.client.get("/metrics", headers=admin)).text
        assert "sk-team-a" not in text and "sk-batch" not in text
        assert _metric(text, "pdrouter_api_key_requests_total", 'key_id="team-a",status="200"') == 2
        assert _metric(text, "pdrouter_api_key_requests_total", 'key_id="team-a",status="429"') == 1
        assert _metric(text, "pdrouter_api_key_rejected_total",
                       'key_id="team-a",limit="requests_per_minute"') == 1  # fmt: skip
        assert _metric(text, "pdrouter_api_key_tokens_total", 'key_id="batch",kind="prompt"') == 6
        assert _metric(text, "pdrouter_api_key_in_flight", 'key_id="team-a"') == 0
        # P and D got each request's priority: the key's default, else 0 (left out)
        priorities = [body.get("priority") for _, body in c.ps[0].seen]
        assert priorities == [3, 3, None]
        assert [body.get("priority") for _, body in c.ds[0].seen] == [3, 3, None]


async def test_the_priority_is_the_field_else_the_header_else_the_keys(tmp_path: Path) -> None:
    async with cluster() as c:
        high = {"X-Priority": "-2"}
        for body, headers in ((BODY, high), ({**BODY, "priority": 7}, high), (BODY, {})):
            resp = await c.client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200
        assert [body.get("priority") for _, body in c.ps[0].seen] == [-2, 7, None]
        bad = await c.client.post("/v1/chat/completions", json=BODY,
                                  headers={"X-Priority": "urgent"})  # fmt: skip
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "x-priority")
        assert "traceparent" not in c.ps[0].seen[0][0]  # tracing off: nothing sent


async def test_the_keys_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    tenancy = TenancyConfig(api_keys_file=path, api_keys_reload_s=0.05)
    async with cluster(tenancy=tenancy) as c:
        new = {"Authorization": "Bearer sk-new"}
        assert (await c.client.post("/v1/chat/completions", json=BODY,
                                    headers=new)).status_code == 401  # fmt: skip
        Path(path).write_text(json.dumps({"keys": [{"id": "new", "key": "sk-new"}]}))
        keys = c.service.tenancy.keys
        assert keys is not None
        await async_wait_until(lambda: keys.num_reloads, 10, "the keys file reloaded")
        assert (await c.client.post("/v1/chat/completions", json=BODY,
                                    headers=new)).status_code == 200  # fmt: skip


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # export at once, not every 5 s
    c = Collector()
    try:
        yield c
    finally:
        c.stop()


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def test_the_router_continues_the_clients_trace_and_parents_p_and_d_on_attempts(
    collector: Collector,
) -> None:
    tracing = TracingConfig(otlp_endpoint=collector.url)
    async with cluster(tracing=tracing) as c:
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "X-Request-Id": "tr-1"}
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY, headers=headers)
        assert resp.status_code == 200
        spans = await async_wait_until(
            lambda: collector.of_trace(TRACE_ID),
            10,
            "the router's spans",
            done=lambda s: len(s) >= 5,
        )
    trace_id = int(TRACE_ID, 16)

    def sid(name: str) -> str:
        return f"{span_id(trace_id, name):016x}"

    root, p_attempt, d_attempt = sid("router.request"), sid(
        "router.prefill.attempt#0"), sid("router.decode.attempt#0")  # fmt: skip
    assert c.ps[0].seen[0][0]["traceparent"] == f"00-{TRACE_ID}-{p_attempt}-01"
    assert c.ds[0].seen[0][0]["traceparent"] == f"00-{TRACE_ID}-{d_attempt}-01"
    tree = sorted((s.name, s.span_id, s.parent_id, s.kind) for s in spans)
    assert tree == sorted([
        ("router.request", root, CLIENT_SPAN, 2),
        ("router.admission", sid("router.admission"), root, 1),
        ("router.prefill.attempt", p_attempt, root, 3),
        ("router.decode.attempt", d_attempt, root, 3),
        ("router.stream", sid("router.stream"), root, 1),
    ])  # fmt: skip
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans} == {"pdrouter-router"}
    assert by_name["router.request"].attributes == {
        "pd.request_id": "tr-1", "pd.endpoint": "chat",
        "gen_ai.request.model": "tiny", "http.response.status_code": 200,
        "pd.priority": 0, "gen_ai.usage.input_tokens": 6,
        "gen_ai.usage.output_tokens": 4, "pd.prefill.worker": c.ps[0].url,
        "pd.prompt_tokens.device": 0, "pd.prompt_tokens.host": 0, "pd.prompt_tokens.pool": 4,
        "pd.prompt_tokens.computed": 2, "pd.handoff.bytes_written": 4096,
        "pd.decode.worker": c.ds[0].url, "pd.handoff.blocks_loaded": 1,
        "pd.handoff.bytes_read": 2048,
    }  # fmt: skip
    assert by_name["router.prefill.attempt"].attributes == {
        "pd.worker": c.ps[0].url, "pd.attempt": 0}  # fmt: skip
    # The spans are the timeline's events: in order, inside the root.
    request = by_name["router.request"]
    assert all(request.start_ns <= s.start_ns <= s.end_ns <= request.end_ns for s in spans)
    assert by_name["router.admission"].end_ns == by_name["router.prefill.attempt"].start_ns
    assert by_name["router.decode.attempt"].end_ns == request.end_ns


async def test_a_request_without_a_traceparent_starts_a_trace(collector: Collector) -> None:
    tracing = TracingConfig(otlp_endpoint=collector.url)
    async with cluster(tracing=tracing) as c:
        assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 200
        sent = c.ps[0].seen[0][0]["traceparent"]
        trace_id = sent.split("-")[1]
        spans = await async_wait_until(
            lambda: collector.of_trace(trace_id),
            10,
            "the router's spans",
            done=lambda s: len(s) >= 4,
        )
    (root,) = [s for s in spans if s.name == "router.request"]
    assert root.parent_id == "" and sent.endswith(
        f"-{span_id(int(trace_id, 16), 'router.prefill.attempt#0'):016x}-01"
    )
