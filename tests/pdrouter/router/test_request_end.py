"""Every way a request can end goes through the router's one end (RouterService._end), exactly
once: counted once by its status, its timeline closed once, its in-flight slot and id given
back. Real loopback HTTP against scripted P and D (test_metrics_flow.cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from pdrouter.router.selection.admission import AdmissionConfig
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, Cluster, cluster
from tests.sse import DONE, sse_data

CHAT = "/v1/chat/completions"


@contextlib.asynccontextmanager
async def ends_recorded(**cfg: Any) -> AsyncIterator[tuple[Cluster, list[tuple[str, int]]]]:
    """A cluster whose service records (request id, status) at each call of its end."""
    async with cluster(**cfg) as c:
        ends: list[tuple[str, int]] = []
        real_end = c.service._end

        def end(request_id: str, endpoint: Any, ctx: Any, error: Any, holding: bool) -> None:
            ends.append((request_id, 200 if error is None else error.status))
            real_end(request_id, endpoint, ctx, error, holding)

        c.service._end = end  # type: ignore[method-assign]
        yield c, ends


def _assert_ended_once(
    c: Cluster, ends: list[tuple[str, int]], request_id: str, status: int, timeline: bool = True
) -> None:
    assert ends == [(request_id, status)]
    text = c.service.metrics.render().decode()
    counted = re.findall(r'^pdrouter_requests_total\{endpoint="chat",status="(\d+)"\} (\S+)$',
                         text, re.MULTILINE)  # fmt: skip
    assert counted == [(str(status), "1.0")]
    assert re.search(r"^pdrouter_requests_in_progress 0\.0$", text, re.MULTILINE)
    assert c.service.in_flight == set()
    assert c.service.admission.num_in_flight == 0
    recorded = c.service.timelines.get(request_id)
    if not timeline:  # refused before its body was read: no timeline was started
        assert recorded is None
        return
    assert recorded is not None and recorded.status == status
    assert [e["status"] for e in recorded.events if e["event"] == "end"] == [status]
    assert recorded.events[-1]["event"] == "end"


async def _post(c: Cluster, body: dict[str, Any], request_id: str, **kw: Any) -> httpx.Response:
    headers = {"X-Request-Id": request_id, **kw.pop("headers", {})}
    return await c.client.post(CHAT, json=body, headers=headers, **kw)


async def test_a_streamed_answer_ends_once_as_200() -> None:
    async with ends_recorded() as (c, ends):
        resp = await _post(c, STREAM_BODY, "s-1")
        assert resp.status_code == 200 and sse_data(resp)[-1] == DONE
        _assert_ended_once(c, ends, "s-1", 200)
        timeline = c.service.timelines.get("s-1")
        assert timeline is not None and timeline.events[-1]["num_output_tokens"] == 4


async def test_a_whole_answer_ends_once_as_200() -> None:
    async with ends_recorded() as (c, ends):
        resp = await _post(c, BODY, "w-1")
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        _assert_ended_once(c, ends, "w-1", 200)


async def test_a_client_gone_mid_stream_ends_once_as_499() -> None:
    async with ends_recorded() as (c, ends):
        d0 = c.ds[0]
        d0.gate = asyncio.Event()  # D holds its final event: the stream stays open
        body = json.dumps(STREAM_BODY).encode()
        got_body = asyncio.Event()
        received = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            received += 1
            if received == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await got_body.wait()
            return {"type": "http.disconnect"}  # gone once the first token is out

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                got_body.set()

        scope = {
            "type": "http", "method": "POST", "path": CHAT, "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"gone-2")],
        }  # fmt: skip
        try:
            await c.service_app(scope, receive, send)
        finally:
            d0.gate.set()
        _assert_ended_once(c, ends, "gone-2", 499)
        timeline = c.service.timelines.get("gone-2")
        assert timeline is not None
        assert timeline.events[-1]["error"] == "client disconnected mid-stream"


async def test_a_decode_failure_after_the_first_token_ends_once_in_band() -> None:
    """D's stream ends unfinished and no other D is left: the 200 is out, so the 502 travels
    as an SSE event; the request counts once, as 502."""
    async with ends_recorded() as (c, ends):
        c.ds[0].cut_after = 1
        resp = await _post(c, STREAM_BODY, "d-1")
        assert resp.status_code == 200
        events = sse_data(resp)
        assert events[-1] == DONE
        assert json.loads(events[-2])["error"]["message"].startswith(
            "decode failed on every instance tried"
        )
        _assert_ended_once(c, ends, "d-1", 502)


@pytest.mark.parametrize(
    ("prefill_status", "status"),
    [
        (500, 502),  # P fails on every attempt
        (400, 400),  # the client's error, passed through
        (401, 502),  # P refused the router: the deployment's error
    ],
)
async def test_a_prefill_answer_that_fails_ends_once(prefill_status: int, status: int) -> None:
    async with ends_recorded() as (c, ends):
        c.ps[0].statuses.extend([prefill_status] * 3)
        resp = await _post(c, STREAM_BODY, "p-1")
        assert resp.status_code == status, resp.text
        _assert_ended_once(c, ends, "p-1", status)
        assert c.ds[0].request_ids == []


async def test_overload_ends_once_as_429() -> None:
    async with ends_recorded(admission=AdmissionConfig(max_in_flight=1)) as (c, ends):
        c.service.admission.enter()  # the one slot is taken
        try:
            resp = await _post(c, BODY, "o-1")
        finally:
            c.service.admission.leave()
        assert resp.status_code == 429 and resp.headers["Retry-After"]
        _assert_ended_once(c, ends, "o-1", 429)
        assert c.ps[0].request_ids == []


@pytest.mark.parametrize(
    ("refusal", "status"),
    [
        (lambda c: _post(c, BODY, "r-1", headers={"Authorization": "Bearer wrong"}), 401),
        (lambda c: _post(c, {"model": "tiny"}, "r-1", headers={"Authorization": "Bearer k"}), 400),
    ],
)
async def test_a_request_refused_at_the_door_ends_once(
    refusal: Callable[[Cluster], Any], status: int
) -> None:
    """The API key or the body refused: no timeline was started, the rest is the same."""
    async with ends_recorded(api_key="k") as (c, ends):
        resp = await refusal(c)
        assert resp.status_code == status, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        _assert_ended_once(c, ends, "r-1", status, timeline=False)
