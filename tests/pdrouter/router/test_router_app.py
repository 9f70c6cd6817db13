"""The router app in-process, with no worker listening: every answer here must come from the
router itself (a 400 proves no worker was touched, since touching one would give 503)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.pdrouter.router.in_process_router import in_process_router

API_KEY = "sk-test-123"
ADMIN_KEY = "admin-test-456"


def _config(api_key: str | None = None, admin_key: str | None = None) -> RouterConfig:
    dead_p = f"http://127.0.0.1:{find_free_port()}"
    dead_d = f"http://127.0.0.1:{find_free_port()}"
    return RouterConfig(
        prefill_urls=(dead_p,),
        decode_urls=(dead_d,),
        orchestrator=OrchestratorConfig(timeouts=HopTimeouts(connect_s=0.5)),
        api_key=api_key,
        admin_key=admin_key,
    )


def _client(cfg: RouterConfig) -> AsyncIterator[httpx.AsyncClient]:
    return in_process_router(cfg, timeout_s=5.0)


@pytest.fixture
async def router() -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client(_config()):
        yield client


@pytest.fixture
async def keyed_router() -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client(_config(API_KEY, ADMIN_KEY)):
        yield client


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "param", "message_part"),
    [
        (CHAT, b"{not json", None, "not valid JSON"),
        (CHAT, b"[1, 2]", None, "must be a JSON object"),
        (CHAT, b'{"model": "tiny"}', "messages", "Field required"),
        (CHAT, b'{"model": "tiny", "messages": []}', "messages", "at least 1 item"),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
            b'"temperature": "hot"}',
            "temperature",
            "valid number",
        ),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17}',
            "n",
            "less than or equal to 16",
        ),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
            b'"top_logprobs": 2}',
            "top_logprobs",
            "top_logprobs needs logprobs set to true",
        ),
        (
            COMPLETIONS,
            b'{"model": "tiny", "prompt": ["a", "b", "c", "d", "e"], "n": 16}',
            "prompt",
            "at most 64 sequences",
        ),
        (
            COMPLETIONS,
            b'{"model": "tiny", "prompt": "a", "n": 2, "best_of": 1}',
            "best_of",
            "must be at least n",
        ),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "a", "echo": 1}', "echo", "valid boolean"),
        (
            COMPLETIONS,
            b'{"model": "tiny", "prompt": "a", "stream_options": {"include_usage": true}}',
            "stream_options",
            "only allowed when stream",
        ),
    ],
)
async def test_bad_bodies_get_400_before_any_worker(
    router: httpx.AsyncClient, path: str, body: bytes, param: str | None, message_part: str
) -> None:
    resp = await router.post(path, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message_part in error["message"]


async def test_unknown_route_and_method_in_openai_shape(router: httpx.AsyncClient) -> None:
    resp = await router.get("/v1/nothing")
    assert resp.status_code == 404
    assert resp.json()["error"]["message"] == "no route GET /v1/nothing"
    assert resp.json()["error"]["code"] == "unknown_url"
    resp = await router.get(CHAT)
    assert resp.status_code == 405
    assert resp.headers["Allow"] == "POST"
    assert resp.json()["error"] == {
        "message": f"method GET not allowed on {CHAT}",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


async def test_a_body_over_the_limit_is_413_and_the_router_keeps_serving() -> None:
    cfg = dataclasses.replace(_config(), max_body_bytes=1000)
    async for router in _client(cfg):
        big = {"model": "tiny", "prompt": "x" * 2000}
        resp = await router.post(COMPLETIONS, json=big, headers={"X-Request-Id": "big-1"})
        assert resp.status_code == 413, resp.text
        assert resp.headers["X-Request-Id"] == "big-1"
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert "larger than 1000 bytes" in error["message"]
        assert "--max-body-bytes" in error["message"]
        # A body just under the limit gets past the size check (to the 503: no D is up).
        small = {"model": "tiny", "prompt": "x" * 10}
        assert (await router.post(COMPLETIONS, json=small)).status_code == 503


async def test_every_refusal_is_counted_by_status_and_carries_the_request_id(
    keyed_router: httpx.AsyncClient,
) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    hi = {"model": "tiny", "prompt": "hi"}
    answers = [
        await keyed_router.post(COMPLETIONS, json=hi),  # 401
        await keyed_router.post(COMPLETIONS, content=b"{", headers=auth),  # 400
        await keyed_router.get(COMPLETIONS, headers=auth),  # 405
        await keyed_router.post(COMPLETIONS, json=hi, headers=auth),  # 503: no D reachable
    ]
    assert [r.status_code for r in answers] == [401, 400, 405, 503]
    ids = [r.headers["X-Request-Id"] for r in answers]
    assert len(set(ids)) == 4 and all(ids)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    text = (await keyed_router.get("/metrics", headers=admin)).text
    for status in (401, 400, 405, 503):
        line = f'pdrouter_requests_total{{endpoint="completions",status="{status}"}} 1.0'
        assert line in text


async def test_no_decode_reachable_is_503_naming_the_stage(router: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = await router.post(CHAT, json=body, headers={"X-Request-Id": "req-nod-1"})
    assert resp.status_code == 503
    assert resp.headers["Retry-After"] == "1"
    assert resp.headers["X-Request-Id"] == "req-nod-1"
    message = resp.json()["error"]["message"]
    assert message.startswith("no decode instance reachable (http://127.0.0.1:")
    assert "ConnectError" in message


async def test_health_is_503_while_no_instance_is_healthy(router: httpx.AsyncClient) -> None:
    resp = await router.get("/health")
    assert resp.status_code == 503
    body = resp.json()
    assert body["status"] == "degraded"
    assert body["num_prefill_healthy"] == 0 and body["num_decode_healthy"] == 0
    assert [i["role"] for i in body["instances"]] == ["prefill", "decode"]


async def test_metrics_expose_instances_and_counters(router: httpx.AsyncClient) -> None:
    text = (await router.get("/metrics")).text
    assert 'pdrouter_instance_up{role="prefill",url="http://127.0.0.1:' in text
    assert "pdrouter_time_to_first_token_seconds_bucket" in text
    assert "pdrouter_pool_bytes_written_total 0.0" in text


async def test_api_key_required_when_set(keyed_router: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hi"}
    resp = await keyed_router.post(COMPLETIONS, json=body)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
    resp = await keyed_router.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401
    resp = await keyed_router.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200
    assert resp.json() == {"object": "list", "data": []}


class _SeenPaths:
    """A pure-ASGI middleware that records every HTTP path it sees."""

    def __init__(self, app: Any, seen: list[str]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append(scope["path"])
        await self.app(scope, receive, send)


def test_add_middleware_is_refused_because_the_openai_routes_would_skip_it() -> None:
    cfg = _config()
    app = create_app(cfg, Registry(list(cfg.prefill_urls), list(cfg.decode_urls)))
    with pytest.raises(TypeError, match=r"would never see them\. Wrap the whole app instead"):
        app.add_middleware(_SeenPaths, seen=[])


async def test_a_wrapped_app_sees_every_route_the_openai_ones_included() -> None:
    cfg = _config()
    app = create_app(cfg, Registry(list(cfg.prefill_urls), list(cfg.decode_urls)))
    seen: list[str] = []
    wrapped = _SeenPaths(app, seen)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        bad = await client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400
        assert (await client.get("/v1/models")).status_code == 200
    assert seen == ["/v1/completions", "/v1/models"]
