"""A streamed answer whose client left as its response started (before any token went out)
still gives back its admission slot, its in-flight entry and its timeline, and D is never
called for it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pdrouter.router.selection.admission import AdmissionConfig
from tests.pdrouter.router.test_metrics_flow import STREAM_BODY, cluster


async def test_client_gone_before_the_stream_starts_releases_everything() -> None:
    async with cluster(admission=AdmissionConfig(max_in_flight=1)) as c:
        app = c.service_app
        body = json.dumps(STREAM_BODY).encode()
        calls = 0
        sent: list[dict[str, Any]] = []
        started = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await started.wait()  # the router watches for a disconnect while P works: none yet
            return {"type": "http.disconnect"}  # gone as soon as the stream starts

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set()
            await asyncio.sleep(0)  # a real socket write may yield to the loop
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"gone-1")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
        }  # fmt: skip
        await app(scope, receive, send)
        assert len(c.ps[0].request_ids) == 1 and c.ds[0].request_ids == []
        assert c.service.in_flight == set()
        assert c.service.admission.num_in_flight == 0
        timeline = c.service.timelines.get("gone-1")
        assert timeline is not None and timeline.status == 499
        # The slot is free again: the next request is served, not refused with 429.
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY)
        assert resp.status_code == 200
